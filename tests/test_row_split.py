"""synkhronos._integrations.row_split: graphs that keep rows apart are split (the sum of the parts equals the
whole, on many random splits), graphs that couple rows are refused whatever the data."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from numpy.testing import assert_allclose

from synkhronos._integrations.row_split import Coupling, split_rows

N = 17
rng = np.random.default_rng(0)
X_VALUE = rng.standard_normal((N, 3))
Y_VALUE = rng.standard_normal(N)
G_VALUE = rng.integers(0, 4, N)


def _leaves():
    X = pytensor.shared(X_VALUE, name="X")
    y = pt.constant(Y_VALUE, name="y")
    g = pytensor.shared(G_VALUE, name="g")
    return X, y, g


def _separable():
    """name -> (term builder over (X, y, g, b, a), whether it keeps rows apart)."""
    rows = pytensor.shared(N, name="n_obs")
    return {
        "elementwise": lambda X, y, g, b, a: -0.5 * (y - X @ b) ** 2 - pt.log(pt.abs(b[0]) + 1),
        "group index": lambda X, y, g, b, a: -((y - a[g]) ** 2),
        "logsumexp across columns": lambda X, y, g, b, a: pt.logsumexp(X * b + y[:, None], axis=1),
        "softmax across columns": lambda X, y, g, b, a: pt.log(pt.special.softmax(X * b, axis=-1))[:, 0] * y,
        "broadcast to dims": lambda X, y, g, b, a: pt.alloc(-y ** 2 * b[1], rows),
        "broadcast to the data's shape": lambda X, y, g, b, a: pt.alloc(-y ** 2 * b[1], y.shape[0]),
        "cumsum across columns": lambda X, y, g, b, a: pt.cumsum(X * b, axis=1)[:, -1] + y,
        "matrix times matrix": lambda X, y, g, b, a: (X @ pt.outer(b, b)).sum(axis=1) + y,
        "rows at their positions": lambda X, y, g, b, a: (X * b)[pt.arange(y.shape[0]), pt.clip(g, 0, 2)],
        # a table indexed by a per-row group index at its column axis: rows along axis 1
        "table column by group index": lambda X, y, g, b, a: pt.outer(b, a)[:, g] * y,
        "table row and group index": lambda X, y, g, b, a: pt.outer(b, a)[1, g] * y + pt.outer(b, a)[2, g],
        "group index after a slice": lambda X, y, g, b, a: pt.outer(b, a)[1:, g].T * X[:, :2],
    }


def _coupled():
    return {
        "mean over rows": lambda X, y, g, b, a: (y - y.mean()) * b[0],
        "sum over rows": lambda X, y, g, b, a: y * pt.sum(X @ b),
        "row count": lambda X, y, g, b, a: y * b[0] / y.shape[0],
        "slice along rows": lambda X, y, g, b, a: (y[1:] - y[:-1]) * b[0],
        "cumsum along rows": lambda X, y, g, b, a: pt.cumsum(y * b[0]),
        "softmax along rows": lambda X, y, g, b, a: pt.log(pt.special.softmax(X @ b, axis=0)),
        "product over rows": lambda X, y, g, b, a: X.T @ y + b[0],
        "join along rows": lambda X, y, g, b, a: pt.concatenate([y, y]) * b[0],
        "reshape of rows": lambda X, y, g, b, a: X.reshape((-1,)) * b[0],
        "sort": lambda X, y, g, b, a: pt.sort(y) * b[0],
        "no rows": lambda X, y, g, b, a: b[0] ** 2,
        # the rule for a table's column read rows along axis 0 there (PyTensor 3): the rows' sum passed
        "table column by group index, summed over rows": lambda X, y, g, b, a: pt.outer(b, a)[:1, g].sum(axis=1) * y,
        "rows along two axes": lambda X, y, g, b, a: pt.outer(a, a)[g][:, g].sum(axis=1) + y,
        "a parameter at the rows' positions": lambda X, y, g, b, a: pt.concatenate([a] * 5)[pt.arange(y.shape[0])] * y,
        "a value of the rows' length not split": lambda X, y, g, b, a: y * pt.arange(17.0) * b[0],
        "transposed rows summed": lambda X, y, g, b, a: X.T.sum(axis=1)[0] * y * b[0],
    }


def _split(term_of):
    X, y, g = _leaves()
    b, a = pt.dvector("b"), pt.dvector("a")
    term = term_of(X, y, g, b, a)
    places = {X: pt.dmatrix("X_rows"), y: pt.dvector("y_rows"), g: pt.lvector("g_rows")}
    (local,) = split_rows([term], places, N)
    whole = pytensor.function([b, a], term.sum(), mode="FAST_COMPILE", on_unused_input="ignore")
    part = pytensor.function([places[X], places[y], places[g], b, a], local.sum(), mode="FAST_COMPILE",
                             on_unused_input="ignore")
    return whole, part


@pytest.mark.parametrize("name", sorted(_separable()))
def test_separable_terms_split_to_the_whole_on_random_splits(name):
    whole, part = _split(_separable()[name])
    r = np.random.default_rng(1)
    for _ in range(25):
        b, a = r.standard_normal(3), r.standard_normal(4)
        cuts = np.sort(r.choice(np.arange(1, N), size=r.integers(1, 4), replace=False))
        bounds = [0, *cuts, N]
        total = sum(part(X_VALUE[lo:hi], Y_VALUE[lo:hi], G_VALUE[lo:hi], b, a) for lo, hi in zip(bounds, bounds[1:]))
        assert_allclose(total, whole(b, a), rtol=1e-12, err_msg=str(bounds))


@pytest.mark.parametrize("name", sorted(_coupled()))
def test_coupled_terms_are_refused(name):
    with pytest.raises(Coupling):
        _split(_coupled()[name])


def test_refusal_does_not_depend_on_the_data():
    """All-zero data hide a mean over rows from any numerical check; not from the graph."""
    X = pytensor.shared(np.zeros((N, 3)))
    y = pytensor.shared(np.zeros(N))
    b = pt.dscalar("b")
    term = -((y - b * (X[:, 0] - X[:, 0].mean())) ** 2)
    with pytest.raises(Coupling, match="reduces over the rows"):
        split_rows([term], {X: pt.dmatrix(), y: pt.dvector()}, N)


def test_a_parameter_check_may_read_every_row():
    """A check whose condition reads every row guards the term (the whole is -inf where one row
    fails, and so is the share that holds that row): with a guard, not a coupling; the guard
    rebuilds the check on each process's rows."""
    from pytensor.raise_op import Assert

    y = pytensor.shared(Y_VALUE)
    s = pt.dscalar("s")
    sigma = pt.exp(y * s)
    term = Assert("sigma > 0")(-y ** 2 / sigma, pt.all(sigma > 0))
    places = {y: pt.dvector("y_rows")}

    def guard(node, inputs):
        if not isinstance(node.op, Assert):
            return None
        return pt.switch(pt.all(inputs[1]), inputs[0], -np.inf)

    with pytest.raises(Coupling, match="reduces over the rows"):
        split_rows([term], places, N)
    (local,) = split_rows([term], places, N, guard)
    part = pytensor.function([places[y], s], local.sum(), mode="FAST_COMPILE")
    assert_allclose(part(Y_VALUE[:5], 0.3) + part(Y_VALUE[5:], 0.3), (-Y_VALUE ** 2 / np.exp(Y_VALUE * 0.3)).sum())


def test_costly_parts_of_the_data_alone_are_computed_once():
    """``gammaln(y + 1)`` reads only the data: it becomes a per-row input computed from them;
    cheap parts (a comparison) and parts that read a parameter stay; the value is the same."""
    from synkhronos._integrations.row_split import hoist_data_only

    y = pt.lvector("y")
    mu = pt.dscalar("mu")
    term = pt.switch(pt.eq(y, 0), 0.0, y * pt.log(mu)) - pt.gammaln(y + 1) - mu + pt.log(mu + y)
    (done,), hoisted = hoist_data_only([term], [y])
    assert len(hoisted) == 1
    (new, graph), = hoisted
    assert "Gammaln" in str(graph.owner.op)
    derive = pytensor.function([y], graph, mode="FAST_COMPILE")
    before = pytensor.function([y, mu], term, mode="FAST_COMPILE")
    after = pytensor.function([y, new, mu], done, mode="FAST_COMPILE")
    r = np.random.default_rng(2)
    for _ in range(10):
        yv, m = r.poisson(3.0, 11), float(r.gamma(2.0))
        assert_allclose(after(yv, derive(yv), m), before(yv, m), rtol=1e-14)
    assert hoist_data_only([pt.eq(y, 0) * mu], [y])[1] == []


def _split_by(term, leaves, n=N, axes=None):
    """``term``'s split, each leaf (its rows along ``axes[leaf]``, 0 by default) given as a
    variable of its rows first; the whole and a part as functions of the parameters."""
    axes = axes or {}
    rows = {leaf: leaf.type.clone(shape=(None,) + tuple(s for j, s in enumerate(leaf.type.shape)
                                                          if j != axes.get(leaf, 0)))() for leaf in leaves}
    back = {leaf: v if not axes.get(leaf) else v.T for leaf, v in rows.items()}
    (local,) = split_rows([term], back, n, axes=axes)
    return local, rows


def test_transposed_data_split_to_the_whole():
    """Data stored feature-major (rows along axis 1, ``X.T``): ``dot(b, XT)`` keeps its rows apart;
    split along the rows of its second axis, the parts add up to the whole."""
    XT = pytensor.shared(X_VALUE.T.copy(), name="XT")
    y = pt.constant(Y_VALUE, name="y")
    b = pt.dvector("b")
    term = -0.5 * (y - pt.dot(b, XT)) ** 2 + (XT.T @ b) * y
    local, rows = _split_by(term, [XT, y], axes={XT: 1})
    whole = pytensor.function([b], term.sum(), mode="FAST_COMPILE")
    part = pytensor.function([rows[XT], rows[y], b], local.sum(), mode="FAST_COMPILE")
    r = np.random.default_rng(3)
    for _ in range(10):
        bv, cut = r.standard_normal(3), int(r.integers(1, N))
        assert_allclose(part(X_VALUE[:cut], Y_VALUE[:cut], bv) + part(X_VALUE[cut:], Y_VALUE[cut:], bv), whole(bv),
                        rtol=1e-12)
    with pytest.raises(Coupling, match="reduces over the rows"):
        _split_by(y * XT.sum(axis=1)[0] * b[0], [XT, y], axes={XT: 1})


M_VALUE = rng.random(N) < 0.4


def test_rows_kept_by_a_mask_split_to_the_whole():
    """``lam[mask]`` with ``y[mask]`` (a per-row boolean mask, censored data written by hand):
    each share keeps its own rows of the mask, and PyMC's broadcast to ``mask.sum()`` rows is
    the count of those rows. Rows kept by another mask, or by none, do not combine with them."""
    X, y = pytensor.shared(X_VALUE, name="X"), pytensor.shared(Y_VALUE, name="y")
    m = pytensor.shared(M_VALUE, name="m")
    b = pt.dvector("b")
    lam = pt.exp(X @ b)
    term = pt.alloc(-lam[~m] * y[~m] + pt.log(lam[~m]), (~m).sum())
    local, rows = _split_by(term, [X, y, m])
    whole = pytensor.function([b], term.sum(), mode="FAST_COMPILE")
    part = pytensor.function([rows[X], rows[y], rows[m], b], local.sum(), mode="FAST_COMPILE")
    r = np.random.default_rng(4)
    for _ in range(10):
        bv, cut = r.standard_normal(3), int(r.integers(1, N))
        got = part(X_VALUE[:cut], Y_VALUE[:cut], M_VALUE[:cut], bv) + part(X_VALUE[cut:], Y_VALUE[cut:], M_VALUE[cut:], bv)
        assert_allclose(got, whole(bv), rtol=1e-12)
    m2 = pytensor.shared(np.random.default_rng(5).permutation(M_VALUE), name="m2")
    for coupled, match in ((lam[m] * y[m2], "different boolean masks"),
                           (lam[m] * y[m].sum(), "reduces over the rows"),
                           (pt.alloc(lam[m], m2.sum()), "another number of rows"),
                           (pt.alloc(lam[m], y.shape[0]), "another number of rows"),
                           (pt.cumsum(lam[m]), "boolean mask"),
                           (b[0] * y[m][1:], "indexes along the rows"),
                           # the first m.sum() rows of all rows: not the rows m keeps
                           (b[0] * y[pt.arange(m.sum())], "boolean mask"),
                           (b[0] * pt.alloc(y, (m.sum() + 0).astype("int64")), "another number of rows")):
        with pytest.raises(Coupling, match=match):
            _split_by(coupled, [X, y, m, m2])
