"""collectives.ops.combine: 0-d parts take a numpy-scalar path (no ufunc call);
its results must be the very bits of the array path, for every op and dtype."""

import warnings

import numpy as np
import pytest

from synkhronos.collectives.ops import combine, result_dtype

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
def test_two_parts_or_more_give_new_memory(dtype, shape):
    """The lanes of planned calls return combine()'s result without a copy."""
    for n in (2, 3):
        parts = [np.full(shape, k + 3).astype(dtype) for k in range(n)]
        for op in OPS:
            for weights in (None, [1.0] * n, list(range(1, n + 1))):
                out = combine(parts, op, weights)
                assert all(out is not p and not np.shares_memory(out, p) for p in parts), (op, n)
    parts = [np.full(shape, 3).astype(dtype), np.full(shape, 5).astype(dtype)]
    if dtype != "bool":
        assert np.all(combine(parts, "avg") == 4.0) and np.all(combine(parts, "sum") == 8)
