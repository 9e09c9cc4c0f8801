"""synkhronos.pymc on the models PyMC users write (tests/pymc_zoo.py): PyMC's own log-density and
gradient at random points, on 1, 2 and 3 processes, or a ValueError naming the variable; never a
different number. Real worker processes; PyMC 5.28 and PyMC 6 (make test runs both)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

pm = pytest.importorskip("pymc")

import synkhronos as synk  # noqa: E402
from conftest import MODE  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning", "ignore::RuntimeWarning")

import pymc_zoo as Z  # noqa: E402

#: Rows of each zoo model: odd, so that every split is uneven.
ROWS = 203


@pytest.fixture(autouse=True)
def fast_compile():
    import pytensor

    with pytensor.config.change_flags(mode=MODE):
        yield


@pytest.fixture(autouse=True)
def no_leaks():
    """conftest's no_leaks closes the fork around every test; here one fork serves the zoo
    (zoo_fork checks for leftovers when it closes)."""
    yield


@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.slow), 2,
                                        pytest.param(3, marks=pytest.mark.slow)])
def zoo_fork(request):
    """One fork per process count for the whole zoo (a fork per model would cost minutes). make test
    takes the zoo on 2 processes; on 1 and 3 (the findings' shapes, set_data) it is marked slow
    and make test-slow runs it."""
    import warnings

    from conftest import child_pids, shm_names

    synk.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        synk.fork(request.param, device="cpu")
    yield request.param
    synk.close()
    assert shm_names() == [] and child_pids() == [], "the zoo's fork left segments or processes"


def _spm():
    import synkhronos.pymc as spm  # imports PyMC's stack: after fork()

    return spm


def _points(model, n, rng):
    """Random points of the value space: continuous values around the initial point (some far
    out, where parameter checks fail), discrete values drawn from their prior."""
    ip = model.initial_point(random_seed=int(rng.integers(1 << 30)))
    points = []
    for i in range(n):
        point = {}
        for v in model.value_vars:
            base = np.asarray(ip[v.name])
            if v.type.dtype.startswith("float"):
                point[v.name] = (base + rng.normal(0, 1.5 if i else 0.5, base.shape)).astype(v.type.dtype)
            else:
                rv = model.values_to_rvs[v]
                point[v.name] = np.asarray(pm.draw(rv, random_seed=int(rng.integers(1 << 30))), dtype=v.type.dtype)
        points.append(point)
    return points


def assert_same_density(model, dp, rng, n_points=4, rtol=1e-9, grad_rtol=1e-8):
    """logp to ``rtol`` and each gradient to ``grad_rtol`` relative to its largest entry (float32
    data: float32's precision), at points where PyMC's logp is finite; the same -inf elsewhere."""
    ref_logp, ref_dlogp = model.compile_logp(mode=MODE), model.compile_dlogp(mode=MODE)
    got_logp, got_dlogp = dp.compile_logp(mode=MODE), dp.compile_dlogp(mode=MODE)
    names = [v.name for v in model.continuous_value_vars]
    assert names == [v.name for v in dp.continuous_value_vars]
    for point in _points(model, n_points, rng):
        want, got = ref_logp(point), got_logp(point)
        if not np.isfinite(want):
            assert got == want, (point, got, want)
            continue
        assert_allclose(got, want, rtol=rtol, err_msg=str(point))
        ref, mine = ref_dlogp(point), got_dlogp(point)
        scale = max(float(np.abs(ref).max(initial=0.0)), 1.0)
        assert_allclose(mine, ref, rtol=grad_rtol, atol=grad_rtol * scale, err_msg=str(point))


@pytest.mark.parametrize("name", sorted(Z.ZOO))
def test_zoo_model_equals_pymc(zoo_fork, name):
    if zoo_fork != 2 and name not in Z.FINDINGS:
        pytest.skip("on 2 processes only (the findings' shapes run on 1, 2 and 3)")
    rng = np.random.default_rng(abs(hash(name)) % (1 << 32))
    model = Z.ZOO[name](rng, ROWS)
    if name == "selected_in_numpy":  # split, but each process computes the covariates of all the rows
        with pytest.warns(UserWarning, match=r"computes the covariates of all the rows.*X\[mask\] @ b"):
            dp = _spm().data_parallel(model, mode=MODE)
    else:
        dp = _spm().data_parallel(model, mode=MODE)
    f32 = "float32" in name
    assert_same_density(model, dp, rng, rtol=1e-5 if f32 else 1e-9, grad_rtol=1e-4 if f32 else 1e-8)


@pytest.mark.parametrize("name", sorted(Z.REFUSED))
def test_zoo_model_refused_clearly(zoo_fork, name):
    if zoo_fork != 2:
        pytest.skip("a refusal does not depend on the number of processes")
    fn, match = Z.REFUSED[name]
    model = fn(np.random.default_rng(1), ROWS)
    with pytest.raises(ValueError, match=match):
        _spm().data_parallel(model, mode=MODE)


def _at(model, **values):
    """The initial point with some values set."""
    point = model.initial_point(random_seed=0)
    point.update({k: np.asarray(v, dtype=point[k].dtype) for k, v in values.items()})
    return point


def test_edge_of_support_is_minus_inf_and_sampling_goes_on(zoo_fork):
    """A parameter out of its support gives PyMC's -inf (PyMC's rewrite of parameter checks),
    never an exception, so NUTS records a divergence and goes on (it aborted before)."""
    if zoo_fork != 2:
        pytest.skip("on 2 processes")
    model = Z.studentt_free_nu(np.random.default_rng(5), ROWS)
    dp = _spm().data_parallel(model, mode=MODE)
    for values in ({"sigma_log__": -800.0}, {"nu_log__": -800.0}, {"sigma_log__": 800.0}):
        point = _at(model, **values)
        assert dp.compile_logp(mode=MODE)(point) == model.compile_logp(mode=MODE)(point), values
    with dp:
        idata = pm.sample(40, tune=40, chains=1, cores=1, random_seed=3, progressbar=False,
                          compute_convergence_checks=False)
    assert idata.posterior["nu"].shape == (1, 40)


def test_find_map_with_dims_on_the_observed(zoo_fork):
    """find_MAP on the dims model, which failed when each share's gradient used all rows."""
    if zoo_fork != 2:
        pytest.skip("on 2 processes")
    model = Z.dims_on_the_observed(np.random.default_rng(6), ROWS)
    dp = _spm().data_parallel(model, mode=MODE)
    with model:
        want = pm.find_MAP(progressbar=False)
    with dp:
        got = pm.find_MAP(progressbar=False)
    assert_allclose(got["s"], want["s"], rtol=1e-6)


def test_set_data_with_coords_follows_the_rows(zoo_fork):
    """pm.set_data of the observed data and its dims' coords to another row count: the shares
    follow (the row count along the dims comes from each process's rows)."""
    if zoo_fork == 1:
        pytest.skip("on 2 and 3 processes")
    rng = np.random.default_rng(7)
    with pm.Model(coords={"obs": np.arange(ROWS)}) as model:
        x = pm.Data("x", rng.standard_normal(ROWS), dims="obs")
        yd = pm.Data("yd", rng.standard_normal(ROWS), dims="obs")
        b = pm.Normal("b", 0, 1)
        s = pm.HalfNormal("s", 2)
        pm.Normal("y", b * x, s, observed=yd, dims="obs")
    dp = _spm().data_parallel(model, mode=MODE)
    new = {"x": rng.standard_normal(150), "yd": rng.standard_normal(150)}
    for m in (model, dp):
        with m:
            pm.set_data(new, coords={"obs": np.arange(150)})
    assert_same_density(model, dp, rng, n_points=3)


@pytest.mark.slow
def test_zoo_in_jax_mode():
    """The findings' shapes through JAX's autodiff (the default where JAX is installed; PyMC 6
    gave a different logp there for the group-index model), on 2 processes, in a fresh Python
    (JAX must start after fork()); mode="JAX" where PyTensor cannot render an op is a
    ValueError that names it. Slow (a JAX compile per shape): make test keeps JAX mode's
    representative, test_pymc.py::test_jax_mode_equals_pymc[2]."""
    pytest.importorskip("jax")
    from test_pymc import _in_a_fresh_process

    _in_a_fresh_process(f"""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        import pytensor
        import synkhronos as synk
        synk.fork(2, device="cpu")
        import pymc as pm
        import pymc_zoo as Z
        import test_pymc_zoo as T
        spm = T._spm()
        with pytensor.config.change_flags(mode=T.MODE):
            for name in Z.JAX_FINDINGS:
                rng = np.random.default_rng(11)
                model = Z.ZOO[name](rng, {ROWS})
                dp = spm.data_parallel(model)  # "auto": JAX wherever PyTensor renders the share in JAX
                jax_path = "JaxValueAndGrad" in str(dp.synk_split.op.fn.fn._spec.outputs[0].owner.op)
                # PyTensor 2 has no JAX rendering of erfcx (a censored Normal's log-cdf): its default
                assert jax_path or name == "censored", name
                T.assert_same_density(model, dp, rng, n_points=3)
                print(name, "ok", flush=True)
            import pytensor.tensor as pt
            with pm.Model() as erfcx:
                mu = pm.Normal("mu", 0, 1)
                pm.Censored("y", pm.Normal.dist(mu, 1), lower=-1.0, upper=1.0,
                            observed=np.clip(rng.normal(0, 1, 50), -1, 1))
            try:
                spm.data_parallel(erfcx, mode="JAX")
            except ValueError as err:
                assert "JAX backend cannot render" in str(err), err
            # rows kept by a boolean mask: JAX's jit takes no boolean index that is not a constant, so
            # "auto" takes PyTensor's default backend there, and mode="JAX" says why it cannot
            model = Z.censored_by_hand(rng, {ROWS})
            dp = spm.data_parallel(model)
            assert "JaxValueAndGrad" not in str(dp.synk_split.op.fn.fn._spec.outputs[0].owner.op)
            T.assert_same_density(model, dp, rng, n_points=3)
            try:
                spm.data_parallel(model, mode="JAX")
                raise AssertionError("mode='JAX' took a boolean mask of rows")
            except ValueError as err:
                assert "boolean mask" in str(err), err
        synk.close()
        print("OK")
    """, timeout=600)


#: The two models where JAX's autodiff gave a NaN gradient (a point near each one's posterior
#: mode, on its own data): the data, the point and PyMC's finite gradient at it.
_NAN_GRADIENT_MODELS = {
    "exgaussian": """
        with pm.Model() as model:
            xd = pm.Data("x", x)
            b = pm.Normal("b", 0, 1)
            s = pm.HalfNormal("s", 1)
            nu = pm.Gamma("nu", 2, 1)
            pm.ExGaussian("y", mu=b * xd, sigma=s, nu=nu, observed=y)
        point = {"b": 1.2461, "s_log__": 0.6746, "nu_log__": -1.6519}
    """,
    "truncated": """
        with pm.Model() as model:
            xd = pm.Data("x", x); ld = pm.Data("lo", lo)
            b = pm.Normal("b", 0, 1); s = pm.HalfNormal("s", 1)
            pm.Truncated("y", pm.Normal.dist(b * xd, s), lower=ld, observed=yt)
        point = {"b": 1.7924, "s_log__": -0.5253}
    """,
}


# one model in make test: the fallback is one mechanism (a lax.cond on the autodiff gradient's
# finiteness, synkhronos/pymc.py), whichever distribution's switch makes the NaN; the other model
# is the same check on another distribution, slow (a fresh Python and a JAX compile: 25 s)
@pytest.mark.parametrize("name", ["exgaussian", pytest.param("truncated", marks=pytest.mark.slow)])
def test_jax_mode_gradient_finite_where_pymcs_is(name):
    """JAX mode differentiates each share with JAX's autodiff, which takes a switch's branch
    not taken into the gradient too: at points near the posterior mode an ExGaussian and a
    Normal truncated at per-row bounds (a normal log-cdf's tail) gave a NaN gradient where
    PyMC's own is finite (found by a hunt on models outside the zoo). There the share takes
    PyTensor's symbolic gradient: PyMC's numbers to 1e-8."""
    pytest.importorskip("jax")
    import textwrap

    from test_pymc import _in_a_fresh_process

    _in_a_fresh_process("""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        import synkhronos as synk
        synk.fork(2, device="cpu")
        import pymc as pm
        import synkhronos.pymc as spm
        rng = np.random.default_rng(0)
        n = 600
        x = rng.standard_normal(n)
        y = x + rng.normal(0, 1, n) + rng.exponential(1, n)
        lo = rng.uniform(-2, 0, n)
        yt = np.maximum(x + rng.normal(0, 1, n), lo + 0.01)
    """ + textwrap.indent(textwrap.dedent(_NAN_GRADIENT_MODELS[name]), " " * 8) + f"""
        name = {name!r}
        dp = spm.data_parallel(model)
        assert "JaxValueAndGrad" in str(dp.synk_split.op.fn.fn._spec.outputs[0].owner.op)
        want_g, got_g = model.compile_dlogp(), dp.compile_dlogp()
        p = {{k: np.asarray(v) for k, v in point.items()}}
        w, g = want_g(p), got_g(p)
        print(name, w, g, flush=True)
        assert np.all(np.isfinite(w)), (name, w)
        np.testing.assert_allclose(g, w, rtol=1e-8, err_msg=name)
        synk.close()
        print("OK")
    """, timeout=600)


def test_float32_model_is_not_refused(zoo_fork):
    """A model built with ``floatX="float32"``: the numeric check compares its float32 sums to
    their own rounding (about 2e-4), not to float64's 1e-8, which refused every such model as
    coupling its rows (found by a hunt); its density is PyMC's to float32's precision."""
    import pytensor

    rng = np.random.default_rng(5)
    g, x = rng.integers(0, 4, ROWS), rng.standard_normal(ROWS).astype("float32")
    with pytensor.config.change_flags(floatX="float32"):
        with pm.Model() as model:
            gi, xd = pm.Data("g", g), pm.Data("x", x)
            a, b = pm.Normal("a", 0, 1, shape=4), pm.Normal("b", 0, 1)
            pm.Poisson("y", pm.math.exp(a[gi] + b * xd), observed=rng.poisson(2, ROWS))
        dp = _spm().data_parallel(model, mode=MODE)
        point = {"a": np.full(4, 0.3, "float32"), "b": np.array(0.1, "float32")}
        np.testing.assert_allclose(dp.compile_logp()(point), model.compile_logp()(point), rtol=1e-6)
        np.testing.assert_allclose(dp.compile_dlogp()(point), model.compile_dlogp()(point), rtol=1e-4)


def test_parts_of_the_data_computed_once_follow_set_data(zoo_fork):
    """Poisson's ``gammaln(y + 1)`` reads only the data: computed once into shared memory, and
    again, with the rows, after every pm.set_data of per-row data (its one validity rule)."""
    if zoo_fork == 1:
        pytest.skip("on 2 and 3 processes")
    rng = np.random.default_rng(8)
    x = rng.standard_normal(ROWS)
    with pm.Model() as model:
        xd = pm.Data("x", x)
        yd = pm.Data("yd", rng.poisson(2.0, ROWS))
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0, 1)
        pm.Poisson("y", pm.math.exp(a + b * xd), observed=yd, shape=xd.shape[0])
    dp = _spm().data_parallel(model, mode=MODE)
    assert dp.synk_split.derived, "gammaln(y + 1) was not computed once"
    compiled = dp.compile_logp(mode=MODE)
    for rows in (ROWS, 120):
        new = {"x": rng.standard_normal(rows), "yd": rng.poisson(5.0, rows)}
        for m in (model, dp):
            with m:
                pm.set_data(new)
        point = _at(model, a=0.3, b=-0.2)
        assert_allclose(compiled(point), model.compile_logp(mode=MODE)(point), rtol=1e-10)
        assert_same_density(model, dp, rng, n_points=2)


#: Shapes through JAX mode's own layout on 3 processes (feature-major matrices, rows padded to
#: 64-row blocks with a row mask, log terms summed apart): 1-, 4- and 8-byte data, matrix and
#: vector products, multivariate rows, two observed variables, a log-sum-exp and StudentT.
JAX_LAYOUT = ("logistic_regression", "categorical_softmax", "bool_data_observed", "float32_data",
              "robust_regression_shape_from_data", "mvnormal_rows", "two_observed_same_rows",
              "negative_binomial_glm", "mixture_of_dists", "transposed_covariates", "table_column_by_group")


@pytest.mark.slow  # JAX's compile per model: about 10 s; make test keeps test_pymc.py's layout test
def test_zoo_in_jax_mode_on_three_processes():
    """JAX mode's layout of each process's rows against PyMC, on 3 processes at row counts
    that split unevenly (203 rows, then 65 after pm.set_data where the model takes it): the
    padding copies must add nothing to value or gradient, a feature-major matrix must be
    read back whole; in a fresh Python (JAX must start after fork())."""
    pytest.importorskip("jax")
    from test_pymc import _in_a_fresh_process

    _in_a_fresh_process(f"""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        import pytensor
        import synkhronos as synk
        synk.fork(3, device="cpu")
        import pymc_zoo as Z
        import test_pymc_zoo as T
        spm = T._spm()
        with pytensor.config.change_flags(mode=T.MODE):
            for name in T.JAX_LAYOUT:
                rng = np.random.default_rng(13)
                model = Z.ZOO[name](rng, {ROWS})
                dp = spm.data_parallel(model)
                split = dp.synk_split
                assert "JaxValueAndGrad" in str(split.op.fn.fn._spec.outputs[0].owner.op), name
                assert split.padded and split.mask.data.sum() == {ROWS}, name
                T.assert_same_density(model, dp, rng, n_points=3)
                print(name, "ok", sorted(split.feature_major), flush=True)
        synk.close()
        print("OK")
    """, timeout=900)


def test_transposed_and_masked_data_follow_set_data(zoo_fork):
    """Per-row data stored along another axis (a feature-major matrix, observed data of shape
    (K, rows)) and rows kept by a per-row boolean mask: after pm.set_data to another row count
    the shares follow (each container's rows along its own axis), the density stays PyMC's."""
    if zoo_fork == 1:
        pytest.skip("on 2 and 3 processes")
    rng = np.random.default_rng(9)
    with pm.Model() as transposed:
        XT, YT = pm.Data("XT", rng.standard_normal((3, ROWS))), pm.Data("YT", rng.standard_normal((2, ROWS)))
        B = pm.Normal("B", 0, 1, shape=(3, 2))
        pm.Normal("y", (XT.T @ B).T, 1, observed=YT)
    for model, new_of in (
            (transposed, lambda n: {"XT": rng.standard_normal((3, n)), "YT": rng.standard_normal((2, n))}),
            (Z.censored_by_hand(rng, ROWS),
             lambda n: {"x": rng.standard_normal(n), "t": rng.exponential(1, n), "cens": rng.random(n) < 0.3}),
            (Z.masked_rows_through_products(rng, ROWS),
             lambda n: {"X": rng.standard_normal((n, 3)), "keep": rng.random(n) < 0.6, "yd": rng.standard_normal(n),
                        "cd": rng.integers(0, 3, n)})):
        dp = _spm().data_parallel(model, mode=MODE)
        for rows in (64, 2):
            new = new_of(rows)
            for m in (model, dp):
                with m:
                    pm.set_data(new)
            assert_same_density(model, dp, rng, n_points=3)


def test_far_out_zero_inflated_poisson_equals_pymc(zoo_fork):
    """A zero-inflated Poisson GLM where the log link underflows (intercept -745: ``exp`` a
    subnormal number): PyMC's rewrites take ``log(exp(eta))`` for ``eta``, and so must the share.
    Before the share was taken after PyMC's pre-gradient rewrites it computed ``log`` of the
    subnormal number instead, in PyTensor's default mode: a logp 2028 off at the first point
    (-2703040.3 against PyMC's -2705068.9) and a gradient 3630 off. The reference is PyMC's
    in the default mode (in FAST_COMPILE PyMC's own logp is -inf there)."""
    if zoo_fork != 2:
        pytest.skip("on 2 processes")
    rng = np.random.default_rng(0)
    n, k = 3000, 3
    X = rng.standard_normal((n, k))
    y = np.where(rng.random(n) < 0.3, 0, rng.poisson(np.exp(0.3 + X @ np.array([0.5, -0.3, 0.2]))))
    with pm.Model() as model:
        a = pm.Normal("a", 0, 10)
        b = pm.Normal("b", 0, 1, shape=k)
        psi = pm.Beta("psi", 2, 2)
        pm.ZeroInflatedPoisson("y", psi, mu=pm.math.exp(a + X @ b), observed=y)
    points = [{"a": -745.0, "b": np.zeros(k), "psi_logodds__": 0.2}]
    for scale, a0 in ((0.3, -745.0), (3.0, -744.6), (0.3, -744.0), (3.0, -740.0)):
        points.append({"a": a0, "b": rng.normal(0, 1e-4 * scale, k), "psi_logodds__": rng.normal(0, scale)})
    ref_logp, ref_dlogp = model.compile_logp(mode="FAST_RUN"), model.compile_dlogp(mode="FAST_RUN")
    for mode in ("FAST_RUN", "FAST_COMPILE"):
        dp = _spm().data_parallel(model, mode=mode)
        got_logp, got_dlogp = dp.compile_logp(mode=mode), dp.compile_dlogp(mode=mode)
        for point in points:
            point = {key: np.asarray(v, dtype="float64") for key, v in point.items()}
            want, ref = ref_logp(point), ref_dlogp(point)
            assert np.isfinite(want) and np.all(np.isfinite(ref)), point
            assert_allclose(got_logp(point), want, rtol=1e-9, err_msg=f"{mode} {point}")
            assert_allclose(got_dlogp(point), ref, rtol=1e-8, atol=1e-8 * max(np.abs(ref).max(), 1.0),
                            err_msg=f"{mode} {point}")


def test_masked_multivariate_rows(zoo_fork):
    """Rows a per-row boolean mask keeps, of a multivariate distribution (a batched op over the
    rows, ``Blockwise``): PyTensor's Python implementation of such an op fails on a batch of no
    rows (in FAST_COMPILE, and in PyTensor 2's default backend), which a process holds where the
    mask keeps none of its rows: refused with that reason (before: as an op not known to keep
    masked rows apart, or with the reason of another row count: the observed data's other
    axis, of 2, before the data's rows, "free variable 'mu' has one entry per row"). A matrix
    product of such rows is split (the zoo's masked_rows_through_products)."""
    if zoo_fork != 2:
        pytest.skip("on 2 processes")
    rng = np.random.default_rng(12)
    X, keep = rng.standard_normal((ROWS, 3)), rng.random(ROWS) < 0.6
    with pm.Model() as model:
        Xd, kd = pm.Data("X", X), pm.Data("keep", keep)
        Yd = pm.Data("Y", X[:, :2] + rng.standard_normal((ROWS, 2)))
        B = pm.Normal("B", 0, 1, shape=(3, 2))
        mu = pm.Normal("mu", 0, 1, shape=2)
        pm.MvNormal("y", mu=(Xd @ B)[kd] + mu, cov=np.eye(2), observed=Yd[kd])
    with pytest.raises(ValueError, match=r"^observed variable 'y': a process may hold none of its rows.*fails on none"):
        _spm().data_parallel(model, mode=MODE)
