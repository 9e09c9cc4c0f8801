"""Small function outputs carried back in the workers' reply areas.

A call whose outputs are small needs no collective at all: each worker writes
its outputs (already in the dtype of their reduction) into its reply area of
the control block just before it answers, and the master, once every worker
has answered, combines them with its own, in rank order, exactly as the
shared-memory communicator would. One wait instead of three, and no pickling.

An area holds int64 words, then the arrays' bytes:

    word 0   state: ABSENT (nothing to add: no rows), INLINE, ELSEWHERE (too
             big for the area: in a segment of their own, see ControlBlock)
    word 1   the weight (float64 bits), for ``avg``
    word 2   the number of arrays, or the segment's generation for ELSEWHERE
    then     per array: dtype character code, ndim, one word per dimension
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ReplyArea", "ABSENT", "INLINE", "ELSEWHERE"]

ABSENT, INLINE, ELSEWHERE = 0, 1, 2
_ALIGN = 16


class ReplyArea:
    """One worker's reply area (a uint8 view of the control block), read and written in place."""

    __slots__ = ("_u8", "_mv", "_words", "_floats", "_cap")

    def __init__(self, area: np.ndarray):
        self._u8 = area
        self._mv = memoryview(area)
        self._cap = area.nbytes
        self._words = area.view(np.int64)
        self._floats = area.view(np.float64)

    def put(self, arrays, weight: float) -> bool:
        """Write ``arrays`` (numpy) and ``weight``; False, writing nothing, when they do not fit."""
        words, n = self._words, len(arrays)
        head = 3 + 2 * n + sum(a.ndim for a in arrays)
        offset = -(-head * 8 // _ALIGN) * _ALIGN
        ends = []
        for a in arrays:
            offset += a.nbytes
            ends.append(offset)
            offset = -(-offset // _ALIGN) * _ALIGN
        if offset > self._cap:
            return False
        w = 3
        start = -(-head * 8 // _ALIGN) * _ALIGN
        for a, end in zip(arrays, ends):
            words[w] = ord(a.dtype.char)
            words[w + 1] = a.ndim
            words[w + 2:w + 2 + a.ndim] = a.shape
            w += 2 + a.ndim
            self._mv[start:end] = np.ascontiguousarray(a).tobytes()
            start = -(-end // _ALIGN) * _ALIGN
        self._floats[1] = weight
        words[2] = n
        words[0] = INLINE
        return True

    def put_absent(self) -> None:
        self._words[0] = ABSENT

    def put_elsewhere(self, generation: int) -> None:
        self._words[2] = generation
        self._words[0] = ELSEWHERE

    def state(self) -> int:
        return int(self._words[0])

    def generation(self) -> int:
        """The segment generation of an ELSEWHERE reply."""
        return int(self._words[2])

    def get(self) -> tuple:
        """``(arrays, weight)`` of an INLINE reply: views of the area (no copy)."""
        words = self._words
        n = int(words[2])
        layout, w = [], 3
        for _ in range(n):
            ndim = int(words[w + 1])
            layout.append((np.dtype(chr(words[w])), tuple(int(d) for d in words[w + 2:w + 2 + ndim])))
            w += 2 + ndim
        offset = -(-w * 8 // _ALIGN) * _ALIGN
        arrays = []
        for dtype, shape in layout:
            count = math.prod(shape)
            arrays.append(np.frombuffer(self._mv, dtype, count, offset).reshape(shape))
            offset = -(-(offset + count * dtype.itemsize) // _ALIGN) * _ALIGN
        return arrays, float(self._floats[1])
