"""Which rows each process computes: batch selection and even splits."""

from __future__ import annotations

import numpy as np

__all__ = []


def split(n_rows: int, n_parts: int, part: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of part ``part`` when ``n_rows`` split as evenly as possible.

    The first ``n_rows % n_parts`` parts get one extra row.
    """
    base, extra = divmod(n_rows, n_parts)
    lo = part * base + min(part, extra)
    return lo, lo + base + (1 if part < extra else 0)


def check_batch(batch, length: int):
    """Normalise a ``batch`` keyword against inputs of ``length`` rows.

    Returns ``None``, a ``slice`` with non-negative bounds, or an int64 index
    array; raises TypeError/IndexError/ValueError naming the value.
    """
    if batch is None:
        return None
    if isinstance(batch, bool):
        raise TypeError(f"batch must be an int, a slice or a list/array of ints, got {batch!r}")
    if isinstance(batch, (int, np.integer)):
        b = int(batch)
        if not 0 <= b <= length:
            raise IndexError(f"batch={b} asks for the first {b} rows, but the inputs have {length} rows")
        return slice(0, b, 1)
    if isinstance(batch, slice):
        for part in ("start", "stop", "step"):
            v = getattr(batch, part)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise TypeError(f"batch slice {part} must be an int or None, got {v!r}")
        if batch.step is not None and batch.step <= 0:
            raise ValueError(f"batch slice step must be positive, got {batch.step}")
        for v in (batch.start, batch.stop):
            if v is not None and not -length <= v <= length:
                raise IndexError(f"batch slice {batch} is out of range for inputs of {length} rows")
        return slice(*batch.indices(length))
    if isinstance(batch, (list, tuple, np.ndarray)):
        idx = np.asarray(batch)
        if idx.size == 0:
            idx = idx.astype(np.int64)
        if idx.ndim != 1:
            raise ValueError(f"batch index array must be 1-d, got shape {idx.shape}")
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"batch index array must hold integers, got dtype {idx.dtype}")
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -length or hi >= length:
                bad = lo if lo < -length else hi
                raise IndexError(f"batch index {bad} is out of range for inputs of {length} rows")
        idx = idx.astype(np.int64, copy=False)
        return np.where(idx < 0, idx + length, idx) if idx.size and lo < 0 else idx
    raise TypeError(f"batch must be an int, a slice or a list/array of ints, got {type(batch).__name__}")


def batch_length(batch, length: int) -> int:
    if batch is None:
        return length
    if isinstance(batch, slice):
        return len(range(batch.start, batch.stop, batch.step))
    return len(batch)


def sub_batch(batch, lo: int, hi: int):
    """Positions ``[lo, hi)`` of a normalised batch, as a slice or index array."""
    if batch is None:
        return slice(lo, hi)
    if isinstance(batch, slice):
        start = batch.start + lo * batch.step
        return slice(start, start + (hi - lo) * batch.step, batch.step)
    return batch[lo:hi]
