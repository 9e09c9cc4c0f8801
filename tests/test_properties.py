"""Property-style checks: distributed results against plain PyTensor and numpy.

Random cases over dtypes (bool, int32, int64, float32, float64), output ops,
sizes on both sides of the chunked-reduction threshold, 1-3 processes,
``batch`` selections and ``num_slices``; then random shared-variable
collectives against a numpy oracle. The seed of every case is in its
failure message, so a failure can be replayed.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import MODE
from numpy.testing import assert_allclose, assert_array_equal

import synkhronos as synk
from synkhronos._batching import split
from synkhronos.collectives import shm

DTYPES = ["bool", "int32", "int64", "float32", "float64"]
#: Columns that make one output row reach the chunked path (for 4-byte dtypes too).
WIDE = shm.CHUNK_THRESHOLD // 4 + 3
CASES_PER_FORK = 60


def _random_matrix(rng, dtype, rows, cols):
    if dtype == "bool":
        return rng.integers(0, 2, (rows, cols)).astype(bool)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, (rows, cols)).astype(dtype)
    return rng.standard_normal((rows, cols)).astype(dtype)


def _build(dtype):
    """One function per dtype with an output for every op."""
    x = pt.matrix("x", dtype=dtype)
    outputs = [
        (x.mean(axis=0), "avg"),
        (x.sum(axis=0), "sum"),
        (x.max(axis=0), "max"),
        (x.min(axis=0), "min"),
        (x.max(axis=0), "avg"),  # an integer output averaged: float64
        (pt.invert(x) if dtype == "bool" else x * 2, "gather"),
        (pt.invert(x) if dtype == "bool" else x + 1, None),
    ]
    if dtype.startswith("float"):
        outputs.append(((1 + 0.01 * x).prod(axis=0), "prod"))
    counter = pytensor.shared(np.int64(0), name=f"count_{dtype}")
    return synk.function([x], outputs, updates=[(counter, counter + 3)], mode=MODE), counter


def _row_blocks(n_rows, n, num_slices):
    """Per rank, the [lo, hi) blocks it computes: its rows, in slices."""
    out = []
    for r in range(n):
        lo, hi = split(n_rows, n, r)
        if hi - lo <= 1 or num_slices == 1:
            out.append([(lo, hi)] if hi > lo else [])
            continue
        blocks = []
        for k in range(num_slices):
            a, b = split(hi - lo, num_slices, k)
            if b > a:
                blocks.append((lo + a, lo + b))
        out.append(blocks)
    return out


def _check_call(f, counter, rng, n, seed):
    dtype = f.inputs[0].type.dtype
    rows = int(rng.choice([1, 2, 3, 5, 8, 17]))
    cols = int(rng.choice([1, 3, 7, WIDE]))
    num_slices = int(rng.choice([1, 1, 2, 3, 5]))
    value = _random_matrix(rng, dtype, rows + 4, cols)
    batch_kind = rng.choice(["none", "slice", "index"])
    if batch_kind == "none":
        value, batch = value[:rows], None
    elif batch_kind == "slice":
        batch = slice(1, 1 + rows)
    else:
        batch = rng.permutation(len(value))[:rows]
    chosen = value if batch is None else value[batch]
    label = f"seed={seed} dtype={dtype} rows={rows} cols={cols} num_slices={num_slices} batch={batch_kind} n={n}"

    before = [synk.get_value(r, counter) for r in range(n)]
    got = f(value, batch=batch, num_slices=num_slices)
    mine = counter.get_value()
    want = f.as_pytensor(chosen)
    tol = dict(rtol=2e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-10, atol=1e-12)

    mean, total, top, bottom, avg_top, gathered, own = got[:7]
    assert mean.dtype == want[0].dtype, label
    assert_allclose(mean, want[0], **tol, err_msg=f"avg: {label}")
    assert total.dtype == want[1].dtype, label
    if dtype.startswith("float"):
        assert_allclose(total, want[1], **tol, err_msg=f"sum: {label}")
    else:
        assert_array_equal(total, want[1], err_msg=f"sum: {label}")
    assert top.dtype == want[2].dtype and bottom.dtype == want[3].dtype, label
    assert_array_equal(top, want[2], err_msg=f"max: {label}")
    assert_array_equal(bottom, want[3], err_msg=f"min: {label}")
    assert_array_equal(gathered, want[5], err_msg=f"gather: {label}")
    assert gathered.dtype == want[5].dtype, label
    master_rows = chosen[slice(*split(rows, n, 0))]
    assert_array_equal(own, f.as_pytensor(master_rows)[6], err_msg=f"None: {label}")
    counter.set_value(mine)  # as_pytensor updated the master's copy: undo it
    if len(got) > 7:
        assert_allclose(got[7], want[7], **tol, err_msg=f"prod: {label}")

    # the avg of an integer output: float64, the row-weighted mean of the blocks' maxima
    blocks = [b for per in _row_blocks(rows, n, num_slices) for b in per]
    maxima = np.asarray([chosen[lo:hi].max(axis=0) for lo, hi in blocks], dtype=np.float64)
    expect = np.average(maxima, axis=0, weights=[hi - lo for lo, hi in blocks])
    want_dtype = np.float64 if dtype in ("bool", "int32", "int64") else np.dtype(dtype)
    assert avg_top.dtype == want_dtype, label
    assert_allclose(avg_top, expect, **tol, err_msg=f"avg of max: {label}")

    # an integer update accumulated with avg over slices: exactly +3 where a process had rows
    after = [synk.get_value(r, counter) for r in range(n)]
    for r in range(n):
        lo, hi = split(rows, n, r)
        assert after[r] == before[r] + (3 if hi > lo else 0), f"counter rank {r}: {label}"


def test_functions_match_pytensor_over_random_cases(forked):
    n = forked
    built = [_build(dtype) for dtype in DTYPES]
    synk.distribute()
    for case in range(CASES_PER_FORK):
        seed = 1000 * n + case
        rng = np.random.default_rng(seed)
        f, counter = built[int(rng.integers(len(built)))]
        _check_call(f, counter, rng, n, seed)


def _oracle(parts, op, dtype):
    """What a collective with ``op`` must leave in a variable of ``dtype``."""
    stacked = np.asarray(parts)
    if op == "avg":
        mean = stacked.astype(np.float64).mean(axis=0)
        return np.rint(mean).astype(dtype) if np.dtype(dtype).kind in "biu" else mean.astype(dtype)
    fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    return fn.reduce(stacked, axis=0).astype(dtype)


def test_collectives_match_numpy_over_random_cases(forked):
    n = forked
    variables = {}
    for dtype in DTYPES:
        for size in (4, WIDE):
            variables[(dtype, size)] = pytensor.shared(np.zeros(size, dtype=dtype), name=f"{dtype}_{size}")
    synk.function([], [pt.sum(v) for v in variables.values()], mode=MODE)
    synk.distribute()
    for case in range(CASES_PER_FORK):
        seed = 7000 * n + case
        rng = np.random.default_rng(seed)
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        size = int(rng.choice([4, WIDE]))
        op = str(rng.choice(["avg", "sum", "prod", "max", "min"]))
        kind = str(rng.choice(["all_reduce", "reduce", "reduce_return"]))
        var = variables[(dtype, size)]
        parts = [_random_matrix(rng, dtype, 1, size)[0] for _ in range(n)]
        if op == "prod" and dtype.startswith("float"):
            parts = [1 + 0.01 * p for p in parts]
        for r, p in enumerate(parts):
            synk.set_value(r, var, p)
        want = _oracle(parts, op, dtype)
        label = f"seed={seed} {kind} op={op} dtype={dtype} size={size} n={n}"
        tol = dict(rtol=2e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-12)
        if kind == "reduce_return":
            got = [synk.reduce(var, op, in_place=False)]
            assert_array_equal(synk.get_value(0, var), parts[0], err_msg=label)  # untouched
        elif kind == "reduce":
            synk.reduce(var, op)
            got = [synk.get_value(0, var)]
            for r in range(1, n):
                assert_array_equal(synk.get_value(r, var), parts[r], err_msg=label)
        else:
            synk.all_reduce(var, op)
            got = [synk.get_value(r, var) for r in range(n)]
        for g in got:
            assert g.dtype == np.dtype(dtype), label
            if dtype.startswith("float"):
                assert_allclose(g, want, **tol, err_msg=label)
            else:
                assert_array_equal(g, want, err_msg=label)
