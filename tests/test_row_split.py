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
        # a batched op's batch axis of rows against a value of the rows' length that is not split
        # (passed: a share of one row broadcast it)
        "batched op with a value along the rows not split": lambda X, y, g, b, a: pt.linalg.solve_triangular(
            pt.alloc(pt.eye(3) + pt.tril(pt.outer(b, b)), 17, 3, 3), X, lower=True, b_ndim=1).sum(axis=1) * y,
        # split at the rows' count: each piece depends on it (passed: the sizes were not followed)
        "split at the row count": lambda X, y, g, b, a: pt.split(
            pt.concatenate([a] * 5), pt.stack([y.shape[0], 20 - y.shape[0]]), n_splits=2)[0].sum() * y,
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
                           (pt.cumsum(lam[m]), "runs along the rows"),
                           (b[0] * y[m][1:], "indexes along the rows"),
                           # the first m.sum() rows of all rows: not the rows m keeps
                           (b[0] * y[pt.arange(m.sum())], "boolean mask"),
                           (b[0] * pt.alloc(y, (m.sum() + 0).astype("int64")), "another number of rows")):
        with pytest.raises(Coupling, match=match):
            _split_by(coupled, [X, y, m, m2])


def _masked_separable():
    """name -> a term over (X, y, g, m, b) of the rows the per-row mask ``m`` keeps, through
    products (Dot, PyTensor's batched matmul), a softmax at the rows' own positions, a broadcast
    to the kept rows' shape, a join along the columns, a batched solve and a cumsum along them."""
    def L(b):  # a lower-triangular matrix of the parameters, invertible
        return pt.eye(3) * 2 + pt.tril(pt.outer(b, b), -1)

    return {
        "dot": lambda X, y, g, m, b: -0.5 * (y[m] - pt.dot(X[m], b)) ** 2,
        "matmul": lambda X, y, g, m, b: -0.5 * (y[m] - X[m] @ b) ** 2,
        "softmax at the kept rows' positions": lambda X, y, g, m, b: y[m] + pt.log(pt.special.softmax(
            X[m] @ pt.outer(b, b), axis=-1))[pt.arange(X[m].shape[0]), pt.clip(g[m], 0, 2)],
        "broadcast to the kept rows' shape": lambda X, y, g, m, b: pt.alloc(y[m] * b[0], y[m].shape[0]),
        "join along the columns": lambda X, y, g, m, b: pt.concatenate([X[m], y[m][:, None]], axis=1)
        @ pt.concatenate([b, b[:1]]),
        "batched solve": lambda X, y, g, m, b: pt.linalg.solve_triangular(L(b), X[m] - b, lower=True,
                                                                          b_ndim=1).sum(axis=1) * y[m],
        "cumsum across columns": lambda X, y, g, m, b: pt.cumsum(X[m] * b, axis=1)[:, -1] * y[m],
    }


@pytest.mark.parametrize("name", sorted(_masked_separable()))
def test_rows_kept_by_a_mask_through_products_and_batched_ops(name):
    """Rows a per-row boolean mask keeps, through ops beyond elementwise ones and indexing (each
    refused before as not known to keep such rows apart): the parts add up to the whole on
    random splits; each op's rule carries the mask (values of rows it keeps combine only with
    values of rows the same mask keeps)."""
    X, y = pytensor.shared(X_VALUE, name="X"), pytensor.shared(Y_VALUE, name="y")
    g, m = pytensor.shared(G_VALUE, name="g"), pytensor.shared(M_VALUE, name="m")
    b = pt.dvector("b")
    term = _masked_separable()[name](X, y, g, m, b)
    local, rows = _split_by(term, [X, y, g, m])
    whole = pytensor.function([b], term.sum(), mode="FAST_COMPILE")
    part = pytensor.function([rows[X], rows[y], rows[g], rows[m], b], local.sum(), mode="FAST_COMPILE",
                             on_unused_input="ignore")
    r = np.random.default_rng(6)
    for _ in range(10):
        bv = r.standard_normal(3) * r.choice([0.3, 3.0])
        bounds = [0, N]
        while bounds == [0, N] or not all(M_VALUE[lo:hi].any() for lo, hi in zip(bounds, bounds[1:])):
            # (each part keeps a row: PyTensor's Python Blockwise fails on a batch of none)
            bounds = [0, *np.sort(r.choice(np.arange(1, N), size=r.integers(1, 4), replace=False)), N]
        got = sum(part(X_VALUE[lo:hi], Y_VALUE[lo:hi], G_VALUE[lo:hi], M_VALUE[lo:hi], bv)
                  for lo, hi in zip(bounds, bounds[1:]))
        assert_allclose(got, whole(bv), rtol=1e-12, err_msg=str(bounds))


def test_rows_kept_by_a_mask_coupled_through_products_and_batched_ops():
    """The same ops where they sum over the kept rows, or combine them with rows kept by another
    mask, or with all rows: refused."""
    X, y = pytensor.shared(X_VALUE, name="X"), pytensor.shared(Y_VALUE, name="y")
    m = pytensor.shared(M_VALUE, name="m")
    m2 = pytensor.shared(np.random.default_rng(5).permutation(M_VALUE), name="m2")
    b = pt.dvector("b")
    eye = pt.eye(3) * 2
    for coupled, match in ((X[m].T @ y[m] + b[0], "sums over the rows"),
                           (pt.dot(X[m], b) * y[m2], "different boolean masks"),
                           ((X[m] @ b) * y, "boolean mask"),
                           (pt.linalg.solve_triangular(eye, X[m] - b, lower=True, b_ndim=1).sum(axis=1) * y[m2],
                            "different boolean masks"),
                           (pt.concatenate([X[m], X[m2]], axis=1) @ pt.concatenate([b, b]), "different boolean masks"),
                           (pt.cumsum(X[m] @ b), "runs along the rows"),
                           (pt.alloc(y * b[0], y[m].shape[0]), "another number of rows"),
                           (b[0] * y[pt.arange(y[m].shape[0])], "boolean mask")):
        with pytest.raises(Coupling, match=match):
            _split_by(coupled, [X, y, m, m2])
