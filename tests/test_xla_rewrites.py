"""synkhronos._integrations.xla_rewrites: each rewrite gives the old graph's values (and, through JAX's
autodiff, its gradients) on many random and extreme inputs, and leaves other graphs alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode
from pytensor.graph.fg import FunctionGraph
from pytensor.raise_op import Assert

from conftest import run_python
from synkhronos._integrations.xla_rewrites import rewrite_for_xla

#: Values where softplus changes branch (-37, 18, 33.3), overflows, or is not finite.
EDGES = np.array([-np.inf, -1e300, -800, -745, -40, -37.5, -37, -36.9, -20, -1, -1e-300, -0.0, 0.0, 1e-300,
                  1, 17.9, 18, 18.1, 30, 33.2, 33.4, 40, 800, 1e300, np.inf, np.nan])
RAW = Mode(linker="py", optimizer=None)  # no rewrite of PyTensor's may fold the new forms back


def _inputs(seed, n=4000):
    rng = np.random.default_rng(seed)
    x = np.concatenate([EDGES, rng.standard_normal(n) * rng.choice([0.1, 3, 30, 300], n)])
    return x, rng


def _rewritten(inputs, outputs):
    fg = FunctionGraph(inputs, outputs, clone=True)
    rewrite_for_xla(fg)
    return fg


def _ops(fg) -> set:
    return {type(getattr(n.op, "scalar_op", n.op)).__name__ for n in fg.apply_nodes}


def _assert_close(got, want, x, what):
    """Equal, both NaN, or within rounding: 4 ulp of the value plus 2 ulp of ``x`` (the
    softplus identities lose at most half an ulp of ``x`` to rounding), in ``got``'s dtype."""
    dtype = np.asarray(got).dtype
    eps = np.finfo(dtype).eps
    got, want = np.broadcast_arrays(np.asarray(got, float), np.asarray(want, float))
    ulp_x = np.broadcast_to(np.spacing(np.abs(np.asarray(x, dtype))).astype(float), got.shape)
    with np.errstate(invalid="ignore"):
        ok = (got == want) | (np.isnan(got) & np.isnan(want)) | (np.abs(got - want) <= 4 * eps * np.abs(want) + 2 * ulp_x)
    assert ok.all(), f"{what}: at x={np.broadcast_to(x, got.shape)[~ok][:5]} got {got[~ok][:5]} want {want[~ok][:5]}"


@pytest.mark.parametrize("cond_dtype", ["int64", "int8", "bool", "float64"])
def test_switch_of_log_sigmoids_equals_the_old_switch(cond_dtype):
    """PyMC's Bernoulli(logit_p) term, both ways round, for every kind of condition
    (0, 1, and values that are neither), on random and extreme logits."""
    x, c = pt.dvector("x"), pt.vector("c", dtype=cond_dtype)
    outs = [pt.switch(c, -pt.softplus(-x), -pt.softplus(x)), pt.switch(c, -pt.softplus(x), -pt.softplus(-x))]
    fg = _rewritten([x, c], outs)
    assert "Softplus" not in _ops(fg) and "Switch" in _ops(fg), _ops(fg)
    old, new = pytensor.function([x, c], outs, mode=RAW), pytensor.function(fg.inputs, fg.outputs, mode=RAW)
    for seed in range(5):
        xs, rng = _inputs(seed)
        conds = [np.zeros(xs.size), np.ones(xs.size), rng.integers(-2, 3, xs.size), rng.random(xs.size) < 0.5]
        for cv in conds:
            cv = np.asarray(cv).astype(cond_dtype)
            for k, (got, want) in enumerate(zip(new(xs, cv), old(xs, cv))):
                _assert_close(got, want, xs, f"switch {k}, condition {cond_dtype}")


def test_softplus_by_abs_equals_softplus():
    x = pt.dvector("x")
    outs = [pt.softplus(x), pt.softplus(-x) * 2, pt.softplus(pt.cast(x, "float32"))]
    fg = _rewritten([x], outs)
    assert "Softplus" not in _ops(fg)
    old, new = pytensor.function([x], outs, mode=RAW), pytensor.function(fg.inputs, fg.outputs, mode=RAW)
    for seed in range(5):
        xs, _ = _inputs(seed)
        with np.errstate(over="ignore", invalid="ignore"):
            got, want = new(xs), old(xs)
        _assert_close(got[0], want[0], xs, "softplus")
        _assert_close(got[1], want[1], xs, "2 softplus(-x)")
        assert got[2].dtype == want[2].dtype == np.float32
        _assert_close(got[2], want[2], xs, "float32 softplus")


def _bernoulli_sum(y, logit, check=True):
    """PyMC's Bernoulli(logit_p) log-likelihood, summed, as PyMC writes it for JAX mode:
    sum(check(switch(y < 0 | y > 1, -inf, switch(y, -softplus(-logit), -softplus(logit)))))."""
    inner = pt.switch(y, -pt.softplus(-logit), -pt.softplus(logit))
    term = pt.switch(pt.or_(pt.lt(y, 0), pt.gt(y, 1)), -np.inf, inner)
    return pt.sum(Assert("0 <= p <= 1")(term, pt.all(pt.ge(pt.sigmoid(logit), 0))) if check else term)


def test_sum_of_switch_less_log_equals_the_old_sum():
    """The log term summed apart: the same sum, -inf where a row is out of the support,
    NaN where a logit is NaN in the support; the check stays around the sum."""
    x, y = pt.dvector("x"), pt.lvector("y")
    total = _bernoulli_sum(y, x)
    fg = _rewritten([x, y], [total])
    sums = [n for n in fg.apply_nodes if type(n.op).__name__ == "Sum"]
    assert len(sums) == 2, "the log term is not summed apart"
    assert fg.outputs[0].owner.op.__class__.__name__ == "Assert", "the check is lost"
    old, new = pytensor.function([x, y], total, mode=RAW), pytensor.function(fg.inputs, fg.outputs[0], mode=RAW)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 300))
        xs = rng.standard_normal(n) * rng.choice([0.1, 3, 30, 300])
        ys = rng.integers(0, 2, n)
        if seed % 4 == 1:  # a row out of the support
            ys[rng.integers(n)] = rng.choice([-1, 2, 7])
        if seed % 4 == 2:  # extreme logits
            xs[: min(n, len(EDGES) - 1)] = EDGES[EDGES == EDGES][: min(n, len(EDGES) - 1)]
        want, got = old(xs, ys), new(xs, ys)
        assert np.isneginf(want) == np.isneginf(got)
        if np.isfinite(want):
            assert abs(got - want) <= 1e-12 * max(abs(want), 1.0), (seed, got, want)
    with pytest.raises(AssertionError, match="0 <= p <= 1"):  # the check still runs
        new(np.array([0.5, np.nan]), np.array([1, 0]))
    # without the check: a NaN logit in the support gives NaN, as before; out of the
    # support the old sum is -inf and the new one NaN (documented)
    unchecked = _bernoulli_sum(y, x, check=False)
    fg = _rewritten([x, y], [unchecked])
    old, new = pytensor.function([x, y], unchecked, mode=RAW), pytensor.function(fg.inputs, fg.outputs[0], mode=RAW)
    assert np.isnan(old(np.array([0.5, np.nan]), np.array([1, 0]))) and np.isnan(new(np.array([0.5, np.nan]), np.array([1, 0])))
    assert np.isneginf(old(np.array([0.5, np.nan]), np.array([1, 2])))
    assert np.isnan(new(np.array([0.5, np.nan]), np.array([1, 2])))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_bounded_link_checks_hold_exactly_where_the_old_ones_do(dtype):
    """``sigmoid(x) >= 0``, ``sigmoid(x) <= 1``, ``exp(x) >= 0`` against ``~isnan(x)`` on random
    and extreme values (infinities, NaN, overflows): the same truth everywhere; and no sigmoid
    or exp left to compute."""
    x = pt.vector("x", dtype=dtype)
    outs = [pt.ge(pt.sigmoid(x), 0), pt.le(pt.sigmoid(x), 1), pt.ge(pt.exp(x), 0)]
    fg = _rewritten([x], outs)
    assert not _ops(fg) & {"Sigmoid", "Exp"}, _ops(fg)
    old, new = pytensor.function([x], outs, mode=RAW), pytensor.function(fg.inputs, fg.outputs, mode=RAW)
    for seed in range(5):
        values, _ = _inputs(seed)
        with np.errstate(all="ignore"):
            values = values.astype(dtype)
            for got, want in zip(new(values), old(values)):
                np.testing.assert_array_equal(got, want)
    # a bound it cannot prove is left alone
    other = _rewritten([x], [pt.ge(pt.sigmoid(x), 0.5), pt.gt(pt.exp(x), 0)])
    assert {"Sigmoid", "Exp"} <= _ops(other)


def test_sum_of_guarded_equals_the_old_sum():
    """``sum(switch(g, x, -inf))`` with one condition for all rows, as PyMC's parameter checks
    become: ``switch(g, sum(x), -inf)``, the same where ``g`` holds and where it fails, with
    infinite and NaN rows; then the log term is summed apart as before."""
    x, y, s = pt.dvector("x"), pt.lvector("y"), pt.dscalar("s")
    term = pt.switch(pt.lt(y, 0), -np.inf, x * y - pt.log1p(pt.exp(x)))
    guarded = pt.switch(pt.all(pt.ge(pt.exp(s), 0)) & (s < 3), term, -np.inf).sum()
    fg = _rewritten([x, y, s], [guarded])
    old = pytensor.function([x, y, s], guarded, mode=RAW)
    new = pytensor.function(fg.inputs, fg.outputs[0], mode=RAW)
    assert fg.outputs[0].owner is not None and "Switch" in str(fg.outputs[0].owner.op)
    for seed in range(10):
        values, rng = _inputs(seed, n=500)
        ys = rng.integers(-1 if seed % 3 == 0 else 0, 4, values.size)
        for sv in (0.5, 5.0, np.nan, -np.inf):
            with np.errstate(all="ignore"):
                got, want = new(values, ys, sv), old(values, ys, sv)
            assert (np.isnan(got) and np.isnan(want)) or got == want or np.isclose(got, want, rtol=1e-12), \
                (seed, sv, got, want)


def test_sums_through_a_row_mask_equal_the_old_masked_sums():
    """A share's padded rows masked out (``sum(switch(m, term, 0))``, synkhronos.pymc in JAX
    mode): the guarded sum and the log term summed apart see through the mask, and give the
    old masked sum where the check holds and fails, with rows out of the support, infinite
    and NaN logits, masks of every kind (all rows, none, random); padded rows are copies
    of real ones, as synkhronos.pymc lays them out."""
    x, y, s, m = pt.dvector("x"), pt.lvector("y"), pt.dscalar("s"), pt.vector("m", dtype="bool")
    term = pt.switch(pt.lt(y, 0), -np.inf, x * y - pt.log1p(pt.exp(x)))
    guarded = pt.switch(pt.all(pt.ge(pt.exp(s), 0)) & (s < 3), term, -np.inf)
    masked = [pt.switch(m, guarded, 0).sum(), pt.switch(m, term, 0).sum()]
    fg = _rewritten([x, y, s, m], masked)
    assert fg.outputs[0].owner is not None and "Switch" in str(fg.outputs[0].owner.op), "not guarded apart"
    sums = [n for n in fg.apply_nodes if type(n.op).__name__ == "Sum"]
    assert len(sums) == 4, f"the log terms are not summed apart: {len(sums)} sums"
    old = pytensor.function([x, y, s, m], masked, mode=RAW)
    new = pytensor.function(fg.inputs, fg.outputs, mode=RAW)
    for seed in range(12):
        values, rng = _inputs(seed, n=300)
        ys = rng.integers(-1 if seed % 3 == 0 else 0, 4, values.size)
        # a NaN logit on a row out of the support: NaN for -inf (sum_of_switch_less_log's note)
        values = np.where((ys < 0) & np.isnan(values), 0.5, values)
        mv = [np.ones(values.size, bool), rng.random(values.size) < 0.7, np.arange(values.size) < 5][seed % 3]
        pad = ~mv
        if mv.any():  # padded rows copy a real one
            values, ys = values.copy(), ys.copy()
            values[pad], ys[pad] = values[np.flatnonzero(mv)[0]], ys[np.flatnonzero(mv)[0]]
        for sv in (0.5, 5.0, np.nan):
            with np.errstate(all="ignore"):
                for got, want in zip(new(values, ys, sv, mv), old(values, ys, sv, mv)):
                    assert (np.isnan(got) and np.isnan(want)) or got == want or np.isclose(got, want, rtol=1e-12), \
                        (seed, sv, got, want)


@pytest.mark.parametrize("masked", [False, True])
def test_sum_of_log_terms_equals_the_old_sum(masked):
    """``sum(c - k * log1p(u))`` (StudentT's term: a row-constant part, a row-constant factor,
    a per-row log) and n-ary sums with a log: the log summed apart, the same sum to rounding,
    and the same infinity or NaN where rows hold infinities or NaN; with and without a row mask."""
    z, s, nu, m = pt.dvector("z"), pt.dscalar("s"), pt.dscalar("nu"), pt.vector("m", dtype="bool")
    c = (pt.gammaln((nu + 1) / 2) - pt.gammaln(nu / 2) - 0.5 * pt.log(np.pi * nu) - pt.log(s)).dimshuffle("x")
    k = (0.5 * (nu + 1)).dimshuffle("x")
    terms = [c - k * pt.log1p(z ** 2 / (nu * s ** 2)),
             z * s + pt.log(pt.abs(z)) - k * pt.log1p(pt.exp(z)) + c,
             -pt.log1p(z ** 2) + z]
    wrap = (lambda t: pt.switch(m, t, 0)) if masked else (lambda t: t)
    outs = [wrap(t).sum() for t in terms]
    fg = _rewritten([z, s, nu, m], outs)
    sums = [n for n in fg.apply_nodes if type(n.op).__name__ == "Sum"]
    assert len(sums) >= 6, f"the log terms are not summed apart: {len(sums)} sums"
    old = pytensor.function([z, s, nu, m], outs, mode=RAW, on_unused_input="ignore")
    new = pytensor.function(fg.inputs, fg.outputs, mode=RAW, on_unused_input="ignore")
    for seed in range(12):
        values, rng = _inputs(seed, n=300)
        mv = [np.ones(values.size, bool), rng.random(values.size) < 0.7, np.zeros(values.size, bool)][seed % 3]
        if seed % 2:  # finite rows only: the sums agree to rounding
            values = values[np.isfinite(values)]
            mv = mv[:values.size]
        for sv, nv in ((1.3, 4.0), (0.2, 1.0), (5.0, 300.0), (np.inf, 2.0), (1.0, np.nan)):
            with np.errstate(all="ignore"):
                for i, (got, want) in enumerate(zip(new(values, sv, nv, mv), old(values, sv, nv, mv))):
                    same = (np.isnan(got) and np.isnan(want)) or got == want
                    # a factor that is not finite: NaN where the old sum is an infinity (or, with
                    # no rows of the share's own, 0)
                    k_inf = i < 2 and not np.isfinite(nv)
                    same = same or (k_inf and np.isnan(got) and (not np.isfinite(want) or not mv.any()))
                    assert same or np.isclose(got, want, rtol=1e-12, atol=1e-9), (seed, sv, nv, i, got, want)


@pytest.mark.parametrize("case", ["axis", "finite constant", "no log", "broadcast log", "plain switch"])
def test_other_graphs_are_left_alone(case):
    x, y, m, r = pt.dvector("x"), pt.lvector("y"), pt.dmatrix("m"), pt.drow("r")
    log = pt.log1p(pt.exp(-pt.abs(x)))
    graphs = {
        "axis": pt.sum(pt.switch(pt.lt(m, 0), -np.inf, m - pt.log(pt.abs(m))), axis=0),
        "finite constant": pt.sum(pt.switch(pt.lt(y, 0), -1e300, x - log)),
        "no log": pt.sum(pt.switch(pt.lt(y, 0), -np.inf, x - pt.exp(x))),
        "broadcast log": pt.sum(pt.switch(pt.lt(m, 0), -np.inf, m - pt.log1p(pt.exp(r)))),  # summed once, not per row
        "plain switch": pt.switch(y, -pt.softplus(x), -pt.softplus(x + 1)),
    }
    out = graphs[case]
    fg = _rewritten(None, [out])
    n_sums = sum(type(n.op).__name__ == "Sum" for n in fg.apply_nodes)
    assert n_sums == (0 if case == "plain switch" else 1), case
    if case == "plain switch":  # its softplus are rewritten, the switch is not
        assert sum(type(getattr(n.op, "scalar_op", None)).__name__ == "Switch" for n in fg.apply_nodes) == 1


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_jax_values_and_gradients_equal_the_old_graph():
    """In JAX, as synkhronos.pymc runs them: value and gradient (JAX's autodiff) of
    PyMC's Bernoulli(logit_p) over a linear predictor, rewritten and not, on random
    points and rows, against the gradient by hand, at logits up to 1e4: where PyMC's
    own rendering gives NaN (past exp's overflow) the rewritten one does not.

    JAX on the CPU, also where a GPU is present: the rewrites are for XLA on the CPU
    (synkhronos.pymc's processes), the 1e-12 tolerances are for its float64 kernels (a
    GPU's XLA has other exp/log1p kernels and summation orders), and this process would
    take the GPU from the tests running beside it. (It failed on an H200 box, traceback
    cut off; with PyTensor 3.0.7 it failed on the CPU too, the rewritten gradient NaN at
    logits near 1000: JAX mode's elemwise fusion had folded the switch into a Composite
    where the rewrites found nothing, now left out by render_for_xla.)"""
    here = Path(__file__).resolve().parent
    done = run_python("""
        import jax, numpy as np, pytensor.tensor as pt
        from scipy.special import expit
        jax.config.update("jax_enable_x64", True)
        from pytensor.compile.mode import get_mode
        from pytensor.graph.fg import FunctionGraph
        from pytensor.link.jax.dispatch import jax_funcify
        from synkhronos._integrations.xla_rewrites import render_for_xla
        from test_xla_rewrites import _bernoulli_sum

        X, y, b, a = pt.dmatrix("X"), pt.lvector("y"), pt.dvector("b"), pt.dscalar("a")
        total = _bernoulli_sum(y, a + X @ b) + pt.sum(pt.softplus(b))

        def vg(rewrite):  # synkhronos.pymc's rendering, or PyTensor's own (PyMC's, numpyro's)
            fg = FunctionGraph([b, a, y, X], [total], clone=True)
            if rewrite:
                inner = render_for_xla(fg)
            else:
                get_mode("JAX").optimizer.rewrite(fg)
                inner = jax_funcify(fg)
            return jax.jit(jax.value_and_grad(lambda b, a, y, X: inner(b, a, y, X)[0], argnums=(0, 1)))

        old, new = vg(False), vg(True)
        rng = np.random.default_rng(0)
        nan_before = 0
        for trial in range(40):
            n, k = (1, 7, 300)[trial % 3], (1, 4)[trial % 2]  # 6 shapes: 6 compilations each way
            scale = [0.1, 1, 10, 100, 1000][trial % 5]
            X_ = rng.standard_normal((n, k))
            y_ = rng.integers(0, 2, n)
            b_, a_ = rng.standard_normal(k) * scale, rng.standard_normal() * scale
            (v0, (gb0, ga0)), (v1, (gb1, ga1)) = old(b_, a_, y_, X_), new(b_, a_, y_, X_)
            assert np.isclose(v1, v0, rtol=1e-12, atol=1e-12), (trial, v1, v0)
            # the gradient by hand: X'(y - sigmoid(eta)) + sigmoid(b), and sum(y - sigmoid(eta))
            r = y_ - expit(a_ + X_ @ b_)
            want = np.append(X_.T @ r + expit(b_), r.sum())
            g0, g1 = np.append(gb0, ga0), np.append(gb1, ga1)
            tol = 1e-10 * max(1.0, np.abs(want).max())
            assert np.allclose(g1, want, rtol=1e-10, atol=tol), (trial, g1, want)
            # PyMC's rendering: NaN where a logit passes exp's overflow (the where-gradient
            # trap of its piecewise softplus); equal elsewhere
            overflow = np.abs(a_ + X_ @ b_).max() > 700 or np.abs(b_).max() > 700
            assert np.allclose(g0, want, rtol=1e-10, atol=tol) or (overflow and np.isnan(g0).any()), (trial, g0)
            nan_before += bool(np.isnan(g0).any())
        assert nan_before > 0, "no trial reached an overflowing logit"
        print("OK")
    """, [here, here.parent], timeout=240, JAX_PLATFORMS="cpu")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_feature_major_layout_gives_back_each_process_rows():
    """feature_major lays each process's rows out as their transpose's memory: FeatureMajor
    of exactly those rows is X[lo:hi].T, for even and uneven splits, empty shares and
    one process; bounds that do not cover the rows in order are refused."""
    from synkhronos._batching import split
    from synkhronos._integrations.xla_rewrites import FeatureMajor, feature_major

    d = pt.dmatrix("d")
    back = pytensor.function([d], FeatureMajor()(d).T, mode=RAW)
    rng = np.random.default_rng(4)
    for n, k, parts in [(1001, 10, 3), (200, 1, 2), (7, 4, 1), (2, 3, 3), (0, 5, 2), (64, 3, 5)]:
        x = rng.standard_normal((n, k))
        bounds = [split(n, parts, r) for r in range(parts)]
        stored = feature_major(x, bounds)
        assert stored.shape == x.shape and stored.flags.c_contiguous
        for lo, hi in bounds:
            np.testing.assert_array_equal(back(stored[lo:hi]), x[lo:hi])
        assert sorted(stored.ravel()) == sorted(x.ravel())
    x = rng.standard_normal((10, 2))
    for bad in ([(0, 4), (5, 10)], [(0, 4), (4, 9)], [(1, 10)]):
        with pytest.raises(ValueError, match="do not cover"):
            feature_major(x, bad)
    with pytest.raises(ValueError, match="takes a matrix"):
        feature_major(np.zeros(3), [(0, 3)])


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_dot_on_feature_major_rows_equals_the_old_dot_in_jax():
    """In JAX, as synkhronos.pymc renders a share whose per-row matrix arrives feature-major:
    dot(X, w) on FeatureMajor storage is rewritten to dot(w.T, XT).T, and the value and
    JAX's gradient equal those of the plain graph on the plain matrix, for vector and
    matrix right sides, on random shapes."""
    here = Path(__file__).resolve().parent
    done = run_python("""
        import jax, numpy as np, pytensor.tensor as pt
        jax.config.update("jax_enable_x64", True)
        from pytensor.graph.fg import FunctionGraph
        from synkhronos._integrations.xla_rewrites import FeatureMajor, feature_major, render_for_xla

        X, D, b, W = pt.dmatrix("X"), pt.dmatrix("D"), pt.dvector("b"), pt.dmatrix("W")
        def total(M):
            return pt.sum(pt.exp(M @ b) * 0.1) + pt.sum(pt.softplus(M @ W)) + pt.sum(M @ b[:, None] * 2)
        plain = FunctionGraph([X, b, W], [total(X)], clone=True)
        fm = FunctionGraph([D, b, W], [total(FeatureMajor()(D).T)], clone=True)
        f_plain, f_fm = render_for_xla(plain), render_for_xla(fm)
        names = {type(n.op).__name__ for n in fm.apply_nodes}
        assert "FeatureMajor" in names, names
        dots = [n for n in fm.apply_nodes if type(n.op).__name__ == "Dot"]
        assert dots and all(getattr(n.inputs[1].owner, "op", None).__class__.__name__ == "FeatureMajor"
                            for n in dots), [str(n) for n in dots]
        vg_plain = jax.jit(jax.value_and_grad(lambda X, b, W: f_plain(X, b, W)[0], argnums=(1, 2)))
        vg_fm = jax.jit(jax.value_and_grad(lambda D, b, W: f_fm(D, b, W)[0], argnums=(1, 2)))
        rng = np.random.default_rng(2)
        for n, k, m in [(1, 1, 1), (7, 3, 2), (300, 10, 4), (1001, 2, 3)]:
            x = rng.standard_normal((n, k))
            b_, W_ = rng.standard_normal(k) * 0.3, rng.standard_normal((k, m))
            (v0, g0), (v1, g1) = vg_plain(x, b_, W_), vg_fm(feature_major(x, [(0, n)]), b_, W_)
            assert np.isclose(v1, v0, rtol=1e-12), (n, k, v1, v0)
            for a, c in zip(g1, g0):
                assert np.allclose(a, c, rtol=1e-11, atol=1e-11), (n, k, a, c)
        print("OK")
    """, [here, here.parent], timeout=240, JAX_PLATFORMS="cpu")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
