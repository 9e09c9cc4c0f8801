"""Reduction operators shared by every communicator backend."""

from __future__ import annotations

import numpy as np

__all__ = ["REDUCE_OPS", "check_op"]

#: name -> numpy ufunc that combines two contributions; "avg" is a weighted sum.
REDUCE_OPS = {
    "sum": np.add,
    "avg": np.add,
    "prod": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def check_op(op, allowed=tuple(REDUCE_OPS), what="op") -> str:
    """Validate a reduce-op name; return it without any ``c_`` prefix."""
    if not isinstance(op, str):
        raise TypeError(f"{what} must be one of {sorted(allowed)}, got {op!r}")
    name = op[2:] if op.startswith("c_") else op
    if name not in allowed:
        raise ValueError(f"unknown {what} {op!r}; expected one of {sorted(allowed)} "
                         "(optionally with a 'c_' prefix)")
    return name


def _fold(ufunc, parts, out=None):
    """``ufunc`` over all of ``parts`` in one pass per extra part (no copy of the first)."""
    if len(parts) == 1:
        if out is None:
            return np.array(parts[0], copy=True)
        np.copyto(out, parts[0])
        return out
    acc = np.asarray(ufunc(parts[0], parts[1], out=out))
    for x in parts[2:]:
        ufunc(acc, x, out=acc)
    return acc


def combine(parts, op: str, weights=None, out=None):
    """Reduce equal-shaped arrays ``parts`` with ``op``.

    ``avg`` is ``sum(w_r * x_r) / sum(w_r)``: equal weights give the sum times
    the reciprocal of the count, row counts give the mean over all rows when
    parts split unevenly.
    """
    if op != "avg":
        return _fold(REDUCE_OPS[op], parts, out)
    n = len(parts)
    w = [1.0] * n if weights is None else [float(x) for x in weights]  # lists: tiny, fast
    total = sum(w)
    w = [x / total for x in w] if total > 0 else [1.0 / n] * n
    dtype = parts[0].dtype
    if dtype.kind in "fc":
        if all(x == w[0] for x in w):
            acc = _fold(np.add, parts, out)
            acc *= dtype.type(w[0])
            return acc
        acc = np.asarray(np.multiply(parts[0], dtype.type(w[0]), out=out))
        tmp = np.empty_like(acc)
        for x, wi in zip(parts[1:], w[1:]):
            np.multiply(x, dtype.type(wi), out=tmp)
            acc += tmp
        return acc
    acc = np.asarray(parts[0] * w[0])
    for x, wi in zip(parts[1:], w[1:]):
        acc += x * wi
    if out is not None:
        out[...] = acc
        return out
    return acc.astype(dtype) if np.issubdtype(dtype, np.bool_) else acc
