"""A sum over rows, in JAX, taken over cache-sized chunks of the rows inside one XLA program.

A process's share of a data-parallel log-likelihood is a sum over its rows of terms that
keep the rows apart (:mod:`synkhronos._integrations.row_split` proves it from the graph),
and so are its gradients with respect to the global parameters. XLA computes such a share
as a series of loops over all of the rows: the matrix product ``X @ b``, several
elementwise passes, the product ``g @ X`` of the gradient. Each loop streams the rows from
memory again, and on a machine whose cores share the memory bandwidth the share is bound by
it. :func:`chunked_over_rows` takes the same function over chunks of rows in a loop
(``lax.fori_loop``): a chunk's rows are read from memory once and every pass over them
hits the cache; the chunks' values and gradients add up to the whole, as the processes'
shares do.

Measured: docs/pymc.rst ("Chunks of rows").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

# the bytes of one chunk's rows, over every per-row input: well inside a core's L2 cache
# (1 MiB on the machines measured), with room for the passes' intermediates (a StudentT
# share of 100,000 rows on one core: 64 KB and 128 KB best among 32 KB to 384 KB)
CHUNK_BYTES = 64 * 1024
# chunks are whole blocks of this many rows (the padding of each process's rows in JAX mode)
ROW_BLOCK = 64


def chunk_rows(row_bytes: int, chunk_bytes: int | None = None) -> int:
    """The rows in one chunk, for rows of ``row_bytes`` bytes: a multiple of
    :data:`ROW_BLOCK`, at least one block."""
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, got {row_bytes!r}")
    return max(ROW_BLOCK, budget // row_bytes // ROW_BLOCK * ROW_BLOCK)


def chunked_over_rows(fn: Callable, rows: Sequence[int], feature_major: Sequence[int],
                      chunk_bytes: int | None = None) -> Callable:
    """``fn`` (JAX, ``(*args) -> tuple of arrays``, each a sum over the rows of the
    per-row arguments) taken over chunks of the rows and summed.

    Args:
        fn: the function; its results must be sums over rows (not checked here: the
            caller proves it).
        rows: positions of the per-row arguments, rows on axis 0.
        feature_major: those of ``rows`` stored feature-major: an ``(n, k)`` array whose
            memory is its rows' transpose (:class:`~synkhronos._integrations.xla_rewrites.FeatureMajor`);
            a chunk of them is again stored so.
        chunk_bytes: the bytes of one chunk's rows over every per-row argument
            (:data:`CHUNK_BYTES` if None); the rows per chunk follow from the arguments'
            shapes and dtypes when JAX traces it (:func:`chunk_rows`).

    With fewer than two whole chunks of rows the function runs once, on all of them.
    The result is the same sum in another order: equal to ``fn``'s up to rounding.
    """
    if chunk_bytes is not None and chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    rows, fm = tuple(rows), frozenset(feature_major)
    if not rows:
        return fn

    def run(*args):
        import jax
        import jax.numpy as jnp
        from jax import lax

        n = args[rows[0]].shape[0]
        chunk = chunk_rows(sum(args[i].dtype.itemsize * math.prod(args[i].shape[1:]) for i in rows) or 1,
                           chunk_bytes)
        whole = n // chunk
        if whole < 2:
            return fn(*args)

        def part(lo, size):
            cut = list(args)
            for i in rows:
                a = args[i]
                if i in fm:  # (k, n) in memory: the chunk is a column block, stored as (size, k)
                    k = a.shape[1]
                    cut[i] = lax.dynamic_slice_in_dim(a.reshape(k, n), lo, size, axis=1).reshape(size, k)
                else:
                    cut[i] = lax.dynamic_slice_in_dim(a, lo, size, axis=0)
            return tuple(fn(*cut))

        def body(j, acc):
            return tuple(s + p for s, p in zip(acc, part(j * chunk, chunk)))

        # (zeros to start: the loop's body is the one copy of the function for whole chunks)
        acc = lax.fori_loop(0, whole, body, tuple(jnp.zeros(r.shape, r.dtype)
                                                  for r in jax.eval_shape(lambda: part(0, chunk))))
        if n > whole * chunk:
            acc = tuple(s + p for s, p in zip(acc, part(whole * chunk, n - whole * chunk)))
        return acc

    return run
