"""The master's scratch Data: staging arrays kept per call or collective in a
pool, reused call after call, grown and shrunk as the calls need."""

from __future__ import annotations

import numpy as np

from ..data import Data, fit, release

__all__ = []


def fit_scratch(pool: dict, key, dtype, shape, name: str) -> Data:
    """The staging Data of ``key`` in ``pool`` (a dict), made to hold ``shape``
    elements of ``dtype``: kept and reused call after call, grown as needed and
    shrunk after a much larger call; a new one if the dtype or the number of
    dimensions changed."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    d = pool.get(key)
    if d is None or d.dtype != dtype or d.ndim != len(shape):
        if d is not None:
            release(d)
        d = pool[key] = Data(dtype, len(shape), name=name, oversize=1.25)
    fit(d, shape)
    return d


def release_scratch(pool: dict, keys, min_bytes: int = 0) -> None:
    """Give back the memory of the staging Data of ``keys`` in ``pool`` that hold
    ``min_bytes`` or more, and forget them."""
    for key in keys:
        d = pool.get(key)
        if d is not None and d.size * d.dtype.itemsize >= min_bytes:
            release(d)
            del pool[key]
