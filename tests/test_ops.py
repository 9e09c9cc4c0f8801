"""collectives.ops.combine: 0-d parts take a numpy-scalar path (no ufunc call);
its results must be the very bits of the array path, for every op and dtype."""

import warnings

import numpy as np
import pytest

from synkhronos.collectives.ops import Reducer, combine, identity, result_dtype

DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool"]
OPS = ["avg", "sum", "prod", "max", "min"]


def _values(rng, dtype, n):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        vals = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
        specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(dtype).max, np.finfo(dtype).tiny]
        for i in range(n):
            if rng.random() < 0.1:
                vals[i] = specials[rng.integers(len(specials))]
        return vals.astype(dtype)
    if dtype.kind == "b":
        return rng.random(n) < 0.5
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)


def _weights(rng, n):
    kind = rng.integers(4)
    if kind == 0:
        return None
    if kind == 1:
        return [float(rng.integers(0, 5))] * n  # equal, maybe all zero
    if kind == 2:
        return [float(w) for w in rng.integers(0, 9, n)]  # row counts, some zero
    return list(rng.random(n))


def test_0d_parts_match_the_array_path_bit_for_bit():
    rng = np.random.default_rng(18)
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflow to inf, inf - inf: both paths
        for _ in range(3000):
            dtype = DTYPES[rng.integers(len(DTYPES))]
            op = OPS[rng.integers(len(OPS))]
            n = int(rng.integers(1, 5))
            vals = _values(rng, dtype, n)
            weights = _weights(rng, n)
            scalar = combine([np.asarray(v) for v in vals], op, weights)
            array = combine([np.asarray([v]) for v in vals], op, weights)
            assert type(scalar) is np.ndarray and scalar.shape == (), (dtype, op, type(scalar))
            assert scalar.dtype == array.dtype == result_dtype(dtype, op), (dtype, op, scalar.dtype)
            same = scalar.reshape(1).view(np.uint8).tobytes() == array.view(np.uint8).tobytes()
            assert same or (np.isnan(scalar) and np.isnan(array[0])), \
                (dtype, op, vals, weights, scalar, array)
            checked += 1
    assert checked == 3000


@pytest.mark.parametrize("shape", [(), (3,)])
@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
def test_the_result_is_new_memory(dtype, shape):
    """The lanes of planned calls and the inline collectives return combine()'s
    result without a copy."""
    for n in (1, 2, 3):
        parts = [np.full(shape, k + 3).astype(dtype) for k in range(n)]
        for op in OPS:
            for weights in (None, [1.0] * n, list(range(1, n + 1))):
                out = combine(parts, op, weights)
                assert all(out is not p and not np.shares_memory(out, p) for p in parts), (op, n)
    parts = [np.full(shape, 3).astype(dtype), np.full(shape, 5).astype(dtype)]
    if dtype != "bool":
        assert np.all(combine(parts, "avg") == 4.0) and np.all(combine(parts, "sum") == 8)


def _reference(parts, op, weights):
    """What combine() promises, written out with plain numpy: a left fold in part
    order; avg as the weighted sum in the result dtype, with the weights as
    fractions of their total (the sum times the reciprocal when they are equal)."""
    rdtype = result_dtype(parts[0].dtype, op)
    if op == "avg" and parts[0].dtype == np.float16:  # in float32, rounded back at the end
        return np.asarray(_reference([np.asarray(p, dtype=np.float32) for p in parts], op, weights)).astype(rdtype)
    if op != "avg":
        ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
        acc = np.array(parts[0], copy=True)
        for p in parts[1:]:
            acc = ufunc(acc, p)
        return np.asarray(acc)
    parts = [np.asarray(p, dtype=rdtype) for p in parts]
    w = [1.0] * len(parts) if weights is None else [float(x) for x in weights]
    total = sum(w)
    w = [x / total for x in w] if total > 0 else [1.0 / len(parts)] * len(parts)
    if w.count(w[0]) == len(w):
        acc = np.array(parts[0], copy=True)
        for p in parts[1:]:
            acc = np.add(acc, p)
        return np.asarray(np.multiply(acc, rdtype.type(w[0])))
    acc = np.multiply(parts[0], rdtype.type(w[0]))
    for p, x in zip(parts[1:], w[1:]):
        acc = np.add(acc, np.multiply(p, rdtype.type(x)))
    return np.asarray(acc)


def test_a_reducer_gives_the_bits_of_a_plain_numpy_fold():
    """Reducer (what a planned call or an inline collective keeps per output),
    into new memory and into a given array, and combine(), against the plain
    numpy fold of _reference, over random ops, dtypes, shapes (0-d, vectors,
    matrices), part counts and weights."""
    rng = np.random.default_rng(81)
    shapes = [(), (1,), (5,), (2, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3000):
            dtype = DTYPES[rng.integers(len(DTYPES))]
            op = OPS[rng.integers(len(OPS))]
            shape = shapes[rng.integers(len(shapes))]
            n = int(rng.integers(1, 5))
            size = int(np.prod(shape))
            parts = [_values(rng, dtype, size).reshape(shape) for _ in range(n)]
            weights = _weights(rng, n)
            reducer = Reducer(op, parts[0].dtype, shape, weights, n)
            assert reducer.fits(parts[0], weights, n)
            for _ in range(2):  # a reducer is used again and again
                want = _reference(parts, op, weights)
                into = np.empty(shape, want.dtype)
                for how, got in (("run", reducer.run(parts)), ("call", reducer(parts)),
                                 ("out", reducer(parts, out=into)), ("combine", combine(parts, op, weights))):
                    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape, how
                    same = got.tobytes() == want.tobytes()
                    assert same or np.array_equal(got, want, equal_nan=True), \
                        (how, dtype, op, shape, weights, got, want)
                assert into.tobytes() == reducer(parts, out=into).tobytes()
                parts = [_values(rng, dtype, size).reshape(shape) for _ in range(n)]


def test_a_reducer_fits_only_what_it_was_made_for():
    r = Reducer("avg", np.float32, (3,), [1.0, 2.0], 2)
    part = np.zeros(3, np.float32)
    assert r.fits(part, [1.0, 2.0], 2)
    assert not r.fits(part, [2.0, 1.0], 2)
    assert not r.fits(part, [1.0, 2.0], 3)
    assert not r.fits(np.zeros(4, np.float32), [1.0, 2.0], 2)
    assert not r.fits(part.astype(np.float64), [1.0, 2.0], 2)
    assert Reducer("sum", np.int64, (), None, 2).fits(np.zeros((), np.int64), [5.0, 1.0], 2)  # weights: avg only


def test_join_stacks_as_numpy_stacks():
    """arrays.join(nd_up=1) copies equal native dtypes into one new array itself:
    the same dtype, shape and bytes as np.stack, over many random cases (byte
    orders, mixed dtypes, empty and 0-d values, non-contiguous views)."""
    from synkhronos._arrays import join
    rng = np.random.default_rng(0)
    kinds = ["f4", "f8", "i8", "u1", "?", "c8", ">f4", "<i2"]
    for case in range(3000):
        shape = tuple(int(d) for d in rng.integers(0, 4, int(rng.integers(0, 4))))
        dtypes = rng.choice(kinds, size=int(rng.integers(1, 3)))
        parts = [(rng.standard_normal(shape) * 10).astype(rng.choice(dtypes)) for _ in range(int(rng.integers(1, 5)))]
        if rng.random() < 0.2:
            parts = [p[..., ::-1] if p.ndim else p for p in parts]
        got, want = join(parts, 1, None), np.stack(parts)
        assert got.dtype == want.dtype and got.shape == want.shape, case
        assert got.tobytes() == want.tobytes() and got.flags.c_contiguous, case
        assert all(not np.shares_memory(got, p) for p in parts), case


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64, np.complex128, np.int32,
                                   np.uint8])
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "max", "min"])
def test_an_identity_element_changes_no_bit(dtype, op):
    """What a node or rank without rows sends where MPI or NCCL needs something: folded
    into any value, that value's bits come back, a zero's sign included (a +0.0 added to
    a sum of -0.0 made it +0.0 when a node had no rows)."""
    if np.dtype(dtype).kind == "c" and op not in ("sum", "avg"):
        pytest.skip("complex: MPI has no max or min of them, and no element keeps every zero's sign "
                    "through a complex product")
    fold = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    e = np.full(5, identity(op, dtype), dtype=dtype)
    if np.dtype(dtype).kind == "c":
        x = np.array([complex(-0.0, 0.0), complex(0.0, -0.0), complex(-2.5, 1.0), complex(-0.0, -0.0),
                      complex(np.inf, 0.0)], dtype=dtype)
    elif np.dtype(dtype).kind == "f":
        x = np.array([-0.0, 0.0, -2.5, 3.0, np.inf], dtype=dtype)
    else:
        info = np.iinfo(dtype)
        x = np.array([0, 1, info.min, info.max, 7], dtype=dtype)
    for a, b in ((x, e), (e, x)):
        got = fold(a, b)
        assert got.dtype == x.dtype and got.tobytes() == x.tobytes(), (op, a, b, got)
