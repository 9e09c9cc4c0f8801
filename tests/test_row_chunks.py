"""synkhronos._integrations.row_chunks: a sum over rows taken over chunks of the rows gives the
whole sum (to rounding) over many random shapes, dtypes, chunk sizes and row counts, with and
without a tail, feature-major matrices included; bad arguments are clear errors. In a fresh
Python: JAX must not start in the process that later forks workers."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import run_python
from synkhronos._integrations.row_chunks import ROW_BLOCK, chunk_rows, chunked_over_rows


def test_chunk_rows_is_whole_blocks_within_the_budget():
    assert chunk_rows(8, 64 * 1024) == 8192
    assert chunk_rows(89, 64 * 1024) == 704  # 736 rows fit; 704 is the largest multiple of 64
    assert chunk_rows(10**9, 64 * 1024) == ROW_BLOCK  # never less than one block
    for row_bytes in range(1, 400, 7):
        rows = chunk_rows(row_bytes, 50_000)
        assert rows % ROW_BLOCK == 0 and (rows == ROW_BLOCK or rows * row_bytes <= 50_000)
    with pytest.raises(ValueError, match="row_bytes must be positive, got 0"):
        chunk_rows(0)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive number of bytes, got 0"):
        chunked_over_rows(lambda *a: a, [0], [], 0)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_chunks_of_rows_add_up_to_the_whole_over_random_cases():
    """A value and gradients of a per-row log-density (a matrix product, a feature-major matrix,
    a mask, a log1p term), in float64 and float32, at 14 random row counts and chunk sizes:
    whole chunks and a tail, two chunks, fewer than two (the function runs once). The chunked
    function compiles to a loop where it has two chunks or more."""
    done = run_python("""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_enable_x64", True)
        from synkhronos._integrations.row_chunks import chunked_over_rows

        def share(X, XT_stored, y, mask, b, s):
            k = XT_stored.shape[1]
            XT = XT_stored.reshape(k, XT_stored.shape[0])        # FeatureMajor in JAX: a reshape
            def value(b, s):
                mu = X @ b + (b @ XT) * 0.5
                z = (y - mu) / s
                t = -jnp.log(s) - 1.5 * jnp.log1p(z * z / 3)
                return jnp.sum(jnp.where(mask, t, 0))
            v, (gb, gs) = jax.value_and_grad(value, argnums=(0, 1))(b, s)
            return v, gb, gs

        rng = np.random.default_rng(7)
        loops = 0
        for case in range(14):
            dtype = np.float64 if case % 3 else np.float32
            k = int(rng.integers(1, 6))
            n = int(rng.integers(1, 40)) * 64 if case % 4 else int(rng.integers(1, 3000))
            X = rng.standard_normal((n, k)).astype(dtype)
            XT_stored = np.ascontiguousarray(rng.standard_normal((n, k)).T).reshape(n, k).astype(dtype)
            y = rng.standard_normal(n).astype(dtype)
            mask = rng.random(n) < 0.9
            b = rng.standard_normal(k).astype(dtype)
            s = dtype(rng.uniform(0.5, 2))
            row_bytes = X.itemsize * k * 2 + y.itemsize + 1
            chunk_bytes = int(rng.integers(1, 8)) * 64 * row_bytes + int(rng.integers(0, row_bytes))
            args = (X, XT_stored, y, mask, b, s)
            whole = jax.jit(share)(*args)
            lowered = jax.jit(chunked_over_rows(share, rows=[0, 1, 2, 3], feature_major=[1],
                                                chunk_bytes=chunk_bytes)).lower(*args)
            loops += "while" in lowered.as_text()
            got = lowered.compile()(*args)
            tol = 2e-4 if dtype == np.float32 else 1e-11
            for g, w in zip(got, whole):
                g, w = np.asarray(g), np.asarray(w)
                assert g.dtype == w.dtype, (case, g.dtype, w.dtype)
                scale = max(float(np.max(np.abs(w))), 1.0)
                assert np.allclose(g, w, rtol=tol, atol=tol * scale), (case, n, chunk_bytes, g, w)
        assert loops >= 8, loops  # most cases took the loop, not the one-run path
        print("OK", loops)
    """, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
