"""Small values inline: one process's area of the shared-memory communicator's inline segment.

Collectives on small shared variables skip the slots, their pickled headers
and the barriers: each process writes its values into its own area, where the
others read them (see shareds.py). An area holds int64 words, then the arrays' bytes:

    word 0   state: EMPTY, VALUES (layout and data), LAYOUT (the layout
             alone: the data did not fit), OVERSIZE (not even the layout fit)
    word 1   the number of arrays
    word 2   the version of the layout: the same layout call after call is
             written once, and read once
    word 3   unused
    then     per array: its dtype's ``str`` (ASCII, in one word), ndim, one
             word per dimension; then the data, each array 16-byte aligned
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["InlineArea", "EMPTY", "VALUES", "LAYOUT", "OVERSIZE", "area_bytes"]

EMPTY, VALUES, LAYOUT, OVERSIZE = range(4)
_HEAD = 4
_ALIGN = 16


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def area_bytes(layout) -> int | None:
    """Bytes an area needs for arrays of ``layout`` (``(dtype, shape)`` pairs);
    None when a dtype cannot be written in the layout (its name is too long)."""
    words = _HEAD
    for dtype, shape in layout:
        if len(dtype.str) > 8:
            return None
        words += 2 + len(shape)
    end = _align(words * 8)
    for dtype, shape in layout:
        end = _align(end + math.prod(shape) * dtype.itemsize)
    return end


class InlineArea:
    """One area (a uint8 view of shared memory), written by one process and read by others.

    The writer keeps views of its own data for the layout it last wrote; a
    reader keeps views for the layout version it last read.
    """

    __slots__ = ("_buf", "_words", "_cap", "_layout", "_wviews", "_version", "_rviews", "_rlayout")

    def __init__(self, area: np.ndarray):
        self._buf = area
        self._cap = area.nbytes
        self._words = area.view(np.int64)
        self._layout = None      # writer: the layout in the header now
        self._wviews = []
        self._version = -1       # reader: the header version its views were made for
        self._rviews = []
        self._rlayout = ()

    def fits(self, layout) -> bool:
        need = area_bytes(layout)
        return need is not None and need <= self._cap

    def write(self, arrays, layout=None) -> bool:
        """Write ``arrays`` (numpy; ``layout``, if given, their ``((dtype, shape), ...)``);
        False when they do not fit (their layout alone is then written if it
        fits, so that a reader can name it)."""
        if layout is None:
            layout = tuple((a.dtype, a.shape) for a in arrays)
        if layout is not self._layout and layout != self._layout:
            need = area_bytes(layout)
            if need is None or not self._write_layout(layout, need):
                return False
        for view, a in zip(self._wviews, arrays):
            view[...] = a  # of the layout's dtype (equal dtypes: byte order too) and shape
        self._words[0] = VALUES
        return True

    def _write_layout(self, layout, need: int) -> bool:
        words, w = self._words, _HEAD
        self._layout, self._wviews = None, []
        if (_HEAD + sum(2 + len(s) for _, s in layout)) * 8 > self._cap:
            words[0] = OVERSIZE
            return False
        for dtype, shape in layout:
            words[w] = int.from_bytes(dtype.str.encode("ascii").ljust(8, b"\0"), "little")
            words[w + 1] = len(shape)
            words[w + 2:w + 2 + len(shape)] = shape
            w += 2 + len(shape)
        words[1] = len(layout)
        words[2] += 1
        if need > self._cap:
            words[0] = LAYOUT
            return False
        self._wviews = self._views(layout, w)
        self._layout = layout
        return True

    def _views(self, layout, w: int) -> list:
        offset, views = _align(w * 8), []
        for dtype, shape in layout:
            n = math.prod(shape) * dtype.itemsize
            views.append(self._buf[offset:offset + n].view(dtype).reshape(shape))
            offset = _align(offset + n)
        return views

    def read(self) -> tuple:
        """``(state, arrays, layout)``: views of the area's arrays (for VALUES)
        and their ``(dtype, shape)`` layout (for VALUES and LAYOUT)."""
        words = self._words
        state = int(words[0])
        if state not in (VALUES, LAYOUT):
            return state, None, None
        version = int(words[2])
        if version != self._version:
            layout, w = [], _HEAD
            for _ in range(int(words[1])):
                name = int(words[w]).to_bytes(8, "little").rstrip(b"\0").decode("ascii")
                ndim = int(words[w + 1])
                layout.append((np.dtype(name), tuple(int(d) for d in words[w + 2:w + 2 + ndim])))
                w += 2 + ndim
            fits = area_bytes(layout) <= self._cap
            self._rviews = self._views(layout, w) if fits else None
            self._rlayout, self._version = tuple(layout), version
        return state, (self._rviews if state == VALUES else None), self._rlayout
