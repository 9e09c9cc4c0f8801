"""synkhronos.pymc: PyMC models data-parallel, against PyMC itself, with real worker processes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

pm = pytest.importorskip("pymc")

import synkhronos as synk  # noqa: E402
from conftest import MODE, run_python  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning", "ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def fast_compile():
    """PyMC compiles with PyTensor's default mode: make it the fastest to compile."""
    import pytensor

    with pytensor.config.change_flags(mode=MODE):
        yield


def _spm():
    import synkhronos.pymc as spm  # imports PyMC's stack: after fork()

    return spm


def logistic_model(n=101, k=3, seed=0, name=""):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, k))
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ rng.standard_normal(k)))).astype("int64")
    with pm.Model(name=name) as model:
        Xd = pm.Data("X", X)
        b = pm.Normal("b", 0, 1, shape=k)
        s = pm.HalfNormal("s", 2.0)
        pm.Bernoulli("y", logit_p=(Xd @ b) * s, observed=y)
    return model


def regression_model(n=57, seed=1):
    """Two observed variables, a global data container, a potential and a transformed prior."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    with pm.Model() as model:
        xd = pm.Data("x", x)
        scale = pm.Data("scale", np.array([1.5, 0.5]))
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0, 1)
        sigma = pm.HalfNormal("sigma", 1.0)
        nu = pm.Gamma("nu", 2.0, 0.5)
        pm.Potential("prior_tilt", -0.5 * (a - b) ** 2)
        pm.Normal("y", a + b * xd * scale[0], sigma, observed=1 + 2 * x + rng.standard_normal(n))
        pm.StudentT("z", nu=nu, mu=b * xd * scale[1], sigma=1.0, observed=rng.standard_normal(n))
    return model


def _points(model, n, seed, scale=0.7):
    """Random points in the (transformed) value space, keyed by value variable name."""
    ip = model.initial_point()
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(0, scale, size=np.shape(v)) for k, v in ip.items()} for _ in range(n)]


def _assert_same_density(model, dp, n_points=6, seed=0, mode=MODE, scale=0.7, ref_mode=None):
    # the same PyTensor mode on both sides: the difference left is the order of the sums
    ref_logp, ref_dlogp = model.compile_logp(mode=ref_mode or mode), model.compile_dlogp(mode=ref_mode or mode)
    got_logp, got_dlogp = dp.compile_logp(mode=mode), dp.compile_dlogp(mode=mode)
    for pt_ in _points(model, n_points, seed, scale):
        assert_allclose(got_logp(pt_), ref_logp(pt_), rtol=1e-10)
        # dlogp ravels the value variables in each model's order: compare by name
        ref = dict(zip([v.name for v in model.continuous_value_vars], _split(model, ref_dlogp(pt_))))
        got = dict(zip([v.name for v in dp.continuous_value_vars], _split(dp, got_dlogp(pt_))))
        _assert_same_gradient(got, ref)


def _assert_same_gradient(got: dict, ref: dict):
    """Gradients by value variable name: equal to 1e-10 relative to the reference's largest entry."""
    assert ref.keys() == got.keys()
    scale = max(np.abs(np.concatenate(list(ref.values()))).max(), 1.0)
    for key in ref:
        assert_allclose(np.ravel(got[key]), ref[key], rtol=1e-10, atol=1e-10 * scale, err_msg=key)


def _split(model, flat):
    ip = model.initial_point()
    out, i = [], 0
    for v in model.continuous_value_vars:
        size = int(np.prod(np.shape(ip[v.name])))
        out.append(flat[i:i + size])
        i += size
    return out


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)],
                         ids=lambda n: f"n{n}")
def test_logp_and_gradient_equal_pymc(fork, n):
    fork(n)
    spm = _spm()
    for model in (logistic_model(), regression_model()):
        dp = spm.data_parallel(model, mode=MODE)
        assert isinstance(dp, pm.Model) and isinstance(dp, spm.DataParallelModel)
        _assert_same_density(model, dp)


def test_far_from_the_mode_density_equals_pymc_in_pytensor_s_modes(fork):
    """Far from the mode (a logistic's linear predictor in the hundreds) the share's logp and
    gradient are PyMC's, taken after PyMC's stabilising rewrites as its dlogp is: without
    them the gradient was NaN in PyTensor's default mode and the logp -inf in FAST_COMPILE.
    The reference: PyMC's in the default mode (FAST_COMPILE leaves PyMC's own logp -inf there)."""
    fork(2)
    spm = _spm()
    rng = np.random.default_rng(53)
    X = rng.standard_normal((53, 3))
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Bernoulli("y", logit_p=X @ b, observed=(rng.standard_normal(53) > 0).astype("int64"))
    for mode in ("FAST_RUN", "FAST_COMPILE"):
        dp = spm.data_parallel(model, mode=mode)
        _assert_same_density(model, dp, n_points=8, seed=3, mode=mode, scale=10.0, ref_mode="FAST_RUN")


def _in_a_fresh_process(code: str, timeout: float = 240) -> str:
    """Run ``code`` in a new Python (tests/ on its path): a test that runs JAX in this process
    would keep the later tests' forked workers from running JAX (they refuse, see
    test_gpu.py::test_workers_refuse_jax_started_before_fork)."""
    here = Path(__file__).resolve().parent
    done = run_python(code, [here, here.parent], timeout=timeout)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_jax_mode_equals_pymc(n):
    """Each process's share by JAX's autodiff (JaxValueAndGrad, the default where JAX is
    installed): logp and gradient equal PyMC's to 1e-10 on 2 and 3 processes (the master's
    share among them; the Op alone is the next test). make test checks JAX mode's density on
    3 processes in the xla-callback and feature-major tests below (a StudentT and a Poisson
    model, padded rows); this one adds the logistic and linear regressions (make test-slow)."""
    pytest.importorskip("jax")
    _in_a_fresh_process(f"""
        import warnings
        warnings.simplefilter("ignore")
        import pytensor
        import synkhronos as synk
        synk.fork({n}, device="cpu")
        import test_pymc as T
        from conftest import MODE
        spm = T._spm()
        with pytensor.config.change_flags(mode=MODE):
            for model in (T.logistic_model(), T.regression_model()):
                dp = spm.data_parallel(model, mode="JAX")
                assert "JaxValueAndGrad" in str(dp.synk_split.op.fn.fn._spec.outputs[0].owner.op), "not the JAX path"
                T._assert_same_density(model, dp)
        synk.close()
        print("OK")
    """)


def test_jax_value_and_grad_equals_symbolic_gradient():
    """The Op alone, in and out of JAX mode, against pytensor.grad on random points; a shared
    variable of the graph is an input like any other."""
    pytest.importorskip("jax")
    _in_a_fresh_process("""
        import numpy as np
        import pytensor
        import pytensor.tensor as pt
        from numpy.testing import assert_allclose
        from synkhronos.pymc import JaxValueAndGrad
        MODE = "FAST_COMPILE"
        rng = np.random.default_rng(3)
        x, w, c = pt.dmatrix("x"), pt.dvector("w"), pt.dscalar("c")
        k = pytensor.shared(rng.standard_normal(4), name="k")
        total = pt.sum(pt.log1p(pt.exp(x @ w * c)) - pt.tanh(x @ k) * c ** 2) + pt.sum(w ** 3)
        want = pytensor.function([x, w, c], [total, *pytensor.grad(total, [w, c])], mode=MODE)
        op = JaxValueAndGrad([x, w, c, k], total, [1, 2])
        for mode in (MODE, "JAX"):
            got = pytensor.function([x, w, c], op(x, w, c, k), mode=mode)
            for _ in range(5):
                args = (rng.standard_normal((7, 4)), rng.standard_normal(4), rng.standard_normal())
                for g, r in zip(got(*args), want(*args)):
                    assert_allclose(np.asarray(g), r, rtol=1e-12, atol=1e-12)
        print("OK")
    """)


def test_rows_named_and_uneven_split(fork):
    fork(3)
    spm = _spm()
    model = logistic_model(n=10)
    dp = spm.data_parallel(model, rows=["X"], mode=MODE)
    _assert_same_density(model, dp, n_points=3)


def test_find_map_and_advi_equal_pymc(fork):
    fork(2)
    spm = _spm()
    model = logistic_model(n=200)
    dp = spm.data_parallel(model, mode=MODE)
    with model:
        ref = pm.find_MAP(progressbar=False)
    with dp:
        got = pm.find_MAP(progressbar=False)
    for key in ref:
        assert_allclose(got[key], ref[key], rtol=1e-6, atol=1e-8, err_msg=key)
    model = regression_model()
    dp = spm.data_parallel(model, mode=MODE)
    # the same random draws in the same order: the same trajectory
    with model:
        ref_fit = pm.fit(300, method="advi", random_seed=3, progressbar=False)
    with dp:
        got_fit = pm.fit(300, method="advi", random_seed=3, progressbar=False)
    assert_allclose(got_fit.hist, ref_fit.hist, rtol=1e-6)
    assert_allclose(got_fit.mean.eval(), ref_fit.mean.eval(), rtol=1e-6)


def test_sample_and_posterior_predictive(fork):
    fork(2)
    spm = _spm()
    model = logistic_model(n=300, k=2)
    dp = spm.data_parallel(model, mode=MODE)
    with dp:
        idata = pm.sample(150, tune=150, chains=1, cores=1, nuts_sampler="pymc", random_seed=1,
                          progressbar=False, compute_convergence_checks=False)
        pp = pm.sample_posterior_predictive(idata, progressbar=False, random_seed=2,
                                            compile_kwargs={"mode": MODE})
    post = idata.posterior["b"].values.reshape(-1, 2)
    with model:
        mode_ = pm.find_MAP(progressbar=False)
    # within Monte Carlo error of the posterior (its mode is close to its mean here)
    sd = post.std(axis=0)
    assert np.all(np.abs(post.mean(axis=0) - mode_["b"]) < 4 * sd)
    assert pp.posterior_predictive["y"].shape == (1, 150, 300)


def test_set_data_after_the_split_is_followed(fork):
    fork(2)
    spm = _spm()
    model = logistic_model(n=40, k=2)
    dp = spm.data_parallel(model, rows=["X"], mode=MODE)
    compiled = dp.compile_logp()  # compiled before the change: its calls follow it too
    point = dp.initial_point()
    rng = np.random.default_rng(9)
    new_X = rng.standard_normal((40, 2))
    with model:
        pm.set_data({"X": new_X})
    with dp:
        pm.set_data({"X": new_X})
    assert_allclose(compiled(point), model.compile_logp()(point), rtol=1e-10)
    _assert_same_density(model, dp, n_points=2)
    with dp:
        pm.set_data({"X": rng.standard_normal((30, 2))})
    with pytest.raises(ValueError, match="different row counts"):
        compiled(point)


def test_bad_models_are_named(fork):
    fork(2)
    spm = _spm()
    with pytest.raises(TypeError, match="takes a pm.Model"):
        spm.data_parallel("model")
    with pm.Model() as no_data:
        pm.Normal("a", 0, 1)
    with pytest.raises(ValueError, match="has no observed variables"):
        spm.data_parallel(no_data)
    with pytest.raises(ValueError, match=r"different row counts \(observed 'y': 20, data 'other': 7\)"):
        with logistic_model(n=20) as m:
            pm.Data("other", np.zeros(7))
        spm.data_parallel(m, rows=["other"])
    with pytest.raises(ValueError, match="'nope' is not a data container"):
        spm.data_parallel(logistic_model(n=20), rows=["nope"])
    rng = np.random.default_rng(0)
    with pm.Model() as latent:
        z = pm.Normal("z", 0, 1, shape=30)
        pm.Normal("y", z, 1, observed=rng.standard_normal(30))
    with pytest.raises(ValueError, match="free variable 'z' has one entry per row"):
        spm.data_parallel(latent)
    with pm.Model() as coupled:
        x = pm.Data("x", rng.standard_normal(30))
        b = pm.Normal("b", 0, 1)
        pm.Normal("y", b * (x - x.mean()), 1, observed=rng.standard_normal(30))
    with pytest.raises(ValueError, match="observed variable 'y' couples its rows"):
        spm.data_parallel(coupled)
    with pm.Model() as walk:
        pm.GaussianRandomWalk("w", sigma=1.0, observed=rng.standard_normal(30).cumsum(),
                              init_dist=pm.Normal.dist(0, 1))
    with pytest.raises(ValueError, match="observed variable 'w' couples its rows"):
        spm.data_parallel(walk)


def test_parallel_chains_refused_clearly(fork):
    fork(2)
    spm = _spm()
    dp = spm.data_parallel(logistic_model(n=30, k=2), mode=MODE)
    with dp, pytest.raises(Exception, match=r"pm.sample\(cores=1\)"):
        pm.sample(10, tune=10, chains=2, cores=2, nuts_sampler="pymc", progressbar=False)


@pytest.mark.parametrize("sampler", [pytest.param("numpyro", marks=pytest.mark.slow), "nutpie"])
def test_other_nuts_samplers(fork, sampler):
    """numpyro through the Op's JAX rendering (one distributed call per value and gradient),
    nutpie through PyTensor's Numba backend (the Op in object mode). numpyro's is slow (make
    test-slow): make test keeps the Op's JAX rendering in test_as_op.py."""
    pytest.importorskip(sampler)
    fork(2)
    spm = _spm()
    model = logistic_model(n=300, k=2)
    # numpyro: the default backend in each process too (JAX where it is installed)
    dp = spm.data_parallel(model, **({} if sampler == "numpyro" else {"mode": MODE}))
    # two chains: nutpie's are threads of the master, which take turns on the fork; numpyro's
    # are vectorised (the callback under vmap runs once per chain)
    chains = 2
    kwargs = {"nuts_sampler_kwargs": {"chain_method": "vectorized"}} if sampler == "numpyro" else {}
    with dp:
        idata = pm.sample(100, tune=100, chains=chains, nuts_sampler=sampler, random_seed=1,
                          progressbar=False, compute_convergence_checks=False, **kwargs)
    post = idata.posterior["b"].values.reshape(-1, 2)
    with model:
        mode_ = pm.find_MAP(progressbar=False)
    assert post.shape == (100 * chains, 2)
    assert np.all(np.abs(post.mean(axis=0) - mode_["b"]) < 4 * post.std(axis=0))


@pytest.mark.slow
def test_demo_runs_and_passes_its_checks():
    import subprocess
    import sys
    from pathlib import Path

    demo = Path(__file__).resolve().parent.parent / "demos" / "pymc_logistic.py"
    done = subprocess.run([sys.executable, str(demo), "--rows", "3000", "--draws", "60", "--processes", "2",
                           "--advi-steps", "200"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "All PyMC checks passed." in done.stdout


@pytest.mark.slow
def test_bench_quick_synk_case(tmp_path):
    """bench/pymc_bench.py runs its synkhronos case end to end (small) and writes its JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench" / "pymc_bench.py"
    out = tmp_path / "pymc.json"
    done = subprocess.run([sys.executable, str(bench), "--quick", "--rows", "2000", "--what", "eval,map",
                           "--cases", "synk", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())["rows"]["2000"]["synk"]
    assert "error" not in result, result
    assert result["eval_ms"] > 0 and result["map_s"] > 0
    if importlib.util.find_spec("matplotlib") is not None:  # the plot beside the JSON
        assert out.with_suffix(".png").stat().st_size > 5_000, done.stdout


def test_set_data_to_another_row_count_is_followed(fork):
    """Observed data in a container: pm.set_data of every per-row container to new rows."""
    fork(3)
    spm = _spm()
    rng = np.random.default_rng(11)

    def build():
        with pm.Model() as model:
            x = pm.Data("x", rng.standard_normal(25))
            y = pm.Data("y", rng.standard_normal(25))
            b = pm.Normal("b", 0, 1)
            sigma = pm.HalfNormal("sigma", 1)
            pm.Normal("obs", b * x, sigma, observed=y, shape=x.shape)
        return model

    model = build()
    dp = spm.data_parallel(model, mode=MODE)
    _assert_same_density(model, dp, n_points=2)
    new = {"x": rng.standard_normal(44), "y": rng.standard_normal(44)}
    for m in (model, dp):
        with m:
            pm.set_data(new)
    _assert_same_density(model, dp, n_points=3, seed=1)


def feature_major_model(rng, n=31):
    with pm.Model() as model:
        X = pm.Data("X", rng.standard_normal((n, 4)))
        y = pm.Data("y", rng.poisson(2.0, n))
        b = pm.Normal("b", 0, 0.5, shape=4)
        pm.Poisson("obs", pm.math.exp(X @ b), observed=y, shape=X.shape[0])
    return model


def test_inside_an_xla_callback_the_masters_share_runs_without_jax():
    """numpyro and blackjax evaluate a data-parallel model through the Op's JAX rendering, an
    XLA host callback, inside which JAX cannot run (pm.sample(nuts_sampler="numpyro") hung
    there now and then: jax-ml/jax#24255). There the master's share is compiled again
    without JAX (host_mode: the value and gradient expanded symbolically, a feature-major
    matrix read by a reshape): on 3 processes with padded blocks, the jitted value and
    gradient equal PyMC's at random points, only the host copy ran in the callback, and
    direct calls (outside JAX) still run the JAX share."""
    pytest.importorskip("jax")
    _in_a_fresh_process("""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        from numpy.testing import assert_allclose
        import pymc as pm
        import synkhronos as synk
        synk.fork(3, device="cpu")
        import jax
        from pymc.sampling.jax import get_jaxified_logp
        from synkhronos.devices.jax_state import jax_linker
        import test_pymc as T
        spm = T._spm()
        rng = np.random.default_rng(5)
        n = 157
        with pm.Model() as studentt:
            X = pm.Data("X", rng.standard_normal((n, 3)))
            b = pm.Normal("b", 0, 1, shape=3)
            nu = pm.Gamma("nu", 2, 0.1)
            s = pm.HalfNormal("s", 2)
            pm.StudentT("y", nu=nu, mu=X @ b, sigma=s, observed=rng.standard_t(4, n))
        model = studentt  # (its X @ b laid out feature-major, its rows padded)
        dp = spm.data_parallel(model, mode="JAX")
        split = dp.synk_split
        assert split.feature_major == {0} and split.padded, (split.feature_major, split.padded)
        names = [v.name for v in dp.value_vars]
        # (PyMC names it backwards: negative_logp=True, its default, is the log-density)
        value_and_grad = jax.jit(jax.value_and_grad(get_jaxified_logp(dp)))
        ref_logp, ref_dlogp = model.compile_logp(), model.compile_dlogp()
        for point in T._points(model, 5, seed=n):
            value, grads = value_and_grad([point[k] for k in names])
            assert_allclose(value, ref_logp(point), rtol=1e-10)
            ref = dict(zip([v.name for v in model.continuous_value_vars], T._split(model, ref_dlogp(point))))
            T._assert_same_gradient(dict(zip(names, grads)), ref)
        compiled = split.op.fn.fn._local._compiled
        host = [fn for key, fn in compiled.items() if key[-1]]
        assert host and not any(jax_linker(fn.maker.linker) for fn in host), compiled
        assert all(jax_linker(fn.maker.linker) for key, fn in compiled.items() if not key[-1]), compiled
        T._assert_same_density(model, dp, n_points=2)  # outside JAX: the JAX share
        import os
        from synkhronos._procs.cores import available_cores
        if available_cores() == 1:  # the master's flags were set before JAX started (as a worker's)
            assert "--xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", ""), os.environ
        synk.close()
        print("OK")
    """)


def test_feature_major_rows_follow_set_data_to_another_row_count():
    """In JAX mode a per-row matrix read by a matrix product goes to the processes
    feature-major, and each process's rows are padded to a 64-row block: on 3 processes at
    uneven row counts the layout follows pm.set_data to other row counts (one row per
    process, an empty share among them), and the density stays PyMC's."""
    pytest.importorskip("jax")
    _in_a_fresh_process("""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        import pymc as pm
        import pytensor
        import synkhronos as synk
        synk.fork(3, device="cpu")
        import test_pymc as T
        from conftest import MODE
        spm = T._spm()
        rng = np.random.default_rng(12)
        with pytensor.config.change_flags(mode=MODE):
            model = T.feature_major_model(rng)
            dp = spm.data_parallel(model, mode="JAX")
            split = dp.synk_split
            assert split.feature_major == {0} and split.padded, (split.feature_major, split.padded)
            T._assert_same_density(model, dp, n_points=3)
            for n in (44, 3, 2, 200):
                new = {"X": rng.standard_normal((n, 4)), "y": rng.poisson(2.0, n)}
                for m in (model, dp):
                    with m:
                        pm.set_data(new)
                T._assert_same_density(model, dp, n_points=3, seed=n)
                assert len(split.mask.data) == 3 * split.block(n) and split.mask.data.sum() == n
        synk.close()
        print("OK")
    """)
