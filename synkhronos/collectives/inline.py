"""Small values inline: one process's area of the shared-memory communicator's inline segment.

Collectives on small shared variables skip the slots, their pickled headers
and the barriers: each process writes its values into its own area, where the
others read them (see synkhronos/_shareds/host.py). An area holds int64 words, then the arrays' bytes:

    word 0   state: EMPTY, VALUES (layout and data), LAYOUT (the layout
             alone: the data did not fit), OVERSIZE (not even the layout fit)
    word 1   the number of arrays
    word 2   the version of the layout: the writer gives each layout a
             version of its own (never reused); readers keep their views
             per version
    word 3   unused
    then     per array: its dtype's ``str`` (ASCII, in one word), ndim, one
             word per dimension; then the data, each array 16-byte aligned

Also the helpers of the inline collectives that ``_shareds/host.py`` and
``_kept/plans.py`` (the kept plans) share: checking a layout, the error of a
layout mismatch, and combining every process's values into this process's.
"""

from __future__ import annotations

import math
import typing

import numpy as np

from .._arrays import packed_views, round_up
from .._kept.records import Table
from .ops import agreed_layout, cast_to, kept_reducer, reducer_of, result_dtype

__all__ = ["InlineArea", "EMPTY", "VALUES", "LAYOUT", "OVERSIZE", "area_bytes",
           "same_layout", "raise_mismatch", "reducers_for", "fold_into", "reduced"]

EMPTY, VALUES, LAYOUT, OVERSIZE = range(4)
_HEAD = 4
_ALIGN = 16


def area_bytes(layout) -> int | None:
    """Bytes an area needs for arrays of ``layout`` (``(dtype, shape)`` pairs);
    None when a dtype cannot be written in the layout (its name is too long)."""
    words = _HEAD
    for dtype, shape in layout:
        if len(dtype.str) > 8:
            return None
        words += 2 + len(shape)
    end = round_up(words * 8, _ALIGN)
    for dtype, shape in layout:
        end = round_up(end + math.prod(shape) * dtype.itemsize, _ALIGN)
    return end


class InlineArea:
    """One area (a uint8 view of shared memory), written by one process and read by others.

    Word 2 names the layout: the writer gives each layout that fits a version
    of its own (never given twice) and keeps its views; a reader keeps its
    views per version. So collectives on values of several layouts, in turn,
    rewrite a header of a few words and reparse nothing.
    """

    __slots__ = ("_buf", "_words", "_head", "_cap", "_layout", "_wviews", "_layouts", "_versions",
                 "_version", "_rviews", "_rlayout", "_seen")

    def __init__(self, area: np.ndarray):
        self._buf = area
        self._cap = area.nbytes
        self._words = area.view(np.int64)
        # the header's words one at a time: a memoryview reads and writes them
        # in a third of a numpy element access's time, on every collective
        # (numpy < 2.5's stubs make an ndarray a Buffer on Python 3.12+ only)
        self._head = memoryview(area)[:_HEAD * 8].cast("q")  # type: ignore[arg-type, unused-ignore]
        self._layout: tuple | None = None  # writer: the layout in the header now, and views where its arrays go
        self._wviews: list[np.ndarray] = []
        self._layouts = Table(_MAX_LAYOUTS)       # writer: layout -> (its version, its views), of the layouts that fit
        self._versions = int(self._head[2])  # writer: the last version given
        self._version = -1       # reader: the header version its views were made for
        self._rviews: list[np.ndarray] | None = []
        self._rlayout: tuple = ()
        self._seen = Table(_MAX_LAYOUTS)          # reader: version -> (layout, views or None) of layouts read before

    def fits(self, layout) -> bool:
        need = area_bytes(layout)
        return need is not None and need <= self._cap

    def write(self, arrays, layout=None) -> bool:
        """Write ``arrays`` (numpy; ``layout``, if given, their ``((dtype, shape), ...)``);
        False when they do not fit (their layout alone is then written if it
        fits, so that a reader can name it)."""
        if layout is None:
            layout = tuple((a.dtype, a.shape) for a in arrays)
        if layout is not self._layout and layout != self._layout and not self._switch(layout):
            return False
        for view, a in zip(self._wviews, arrays):
            view[...] = a  # of the layout's dtype (equal dtypes: byte order too) and shape
        self._head[0] = VALUES
        return True

    def _switch(self, layout) -> bool:
        """Put the header of ``layout`` in place; False when its values do not fit."""
        got = self._layouts.get(layout)
        if got is not None:
            self._write_header(layout, got[0])
            self._layout, self._wviews = layout, got[1]
            return True
        self._layout, self._wviews = None, []
        need = area_bytes(layout)
        if need is None or (_HEAD + sum(2 + len(s) for _, s in layout)) * 8 > self._cap:
            self._head[0] = OVERSIZE
            return False
        self._versions += 1
        w = self._write_header(layout, self._versions)
        if need > self._cap:
            self._head[0] = LAYOUT
            return False
        views = self._views(layout, w)
        self._layouts.keep(layout, (self._versions, views))
        self._layout, self._wviews = layout, views
        return True

    def _write_header(self, layout, version: int) -> int:
        """Write ``layout`` and its version into the header; returns the word after it."""
        words, w = self._words, _HEAD
        for dtype, shape in layout:
            words[w] = int.from_bytes(dtype.str.encode("ascii").ljust(8, b"\0"), "little")
            words[w + 1] = len(shape)
            words[w + 2:w + 2 + len(shape)] = shape
            w += 2 + len(shape)
        self._head[1] = len(layout)
        self._head[2] = version
        return w

    def _views(self, layout, w: int) -> list:
        return packed_views(self._buf, layout, round_up(w * 8, _ALIGN), _ALIGN)

    def read(self) -> tuple:
        """``(state, arrays, layout)``: views of the area's arrays (for VALUES)
        and their ``(dtype, shape)`` layout (for VALUES and LAYOUT)."""
        head = self._head
        state = head[0]
        if state != VALUES and state != LAYOUT:
            return state, None, None
        version = head[2]
        if version != self._version:
            got = self._seen.get(version)
            if got is None:
                got = self._seen.keep(version, self._read_layout())
            (self._rlayout, self._rviews), self._version = got, version
        return state, (self._rviews if state == VALUES else None), self._rlayout

    def _read_layout(self) -> tuple:
        """``(layout, views or None)`` of the header in place (views when its values fit)."""
        words, layout, w = self._words, [], _HEAD
        for _ in range(int(words[1])):
            name = int(words[w]).to_bytes(8, "little").rstrip(b"\0").decode("ascii")
            ndim = int(words[w + 1])
            layout.append((np.dtype(name), tuple(int(d) for d in words[w + 2:w + 2 + ndim])))
            w += 2 + ndim
        fits = self.fits(layout)  # (always a layout the writer could write: its size is known)
        return tuple(layout), (self._views(layout, w) if fits else None)


#: Layouts an area's writer and each reader keep (each starts again past this many).
_MAX_LAYOUTS = 64


# ---------------------------------------------------------------------------
# Helpers of the inline collectives (_shareds/host.py) and their kept plans (_kept/plans.py).


def same_layout(values, layout) -> bool:
    """Whether ``values`` have the very dtypes (the same objects, as a loop gives
    them) and the shapes of ``layout``; False sends the caller to the full check."""
    if len(values) != len(layout):
        return False
    for a, (dtype, shape) in zip(values, layout):
        if type(a) is not np.ndarray or a.dtype is not dtype or a.shape != shape:
            return False
    return True


def raise_mismatch(comm, layout, op) -> typing.NoReturn:
    """The error of an inline reduction whose processes hold different layouts."""
    layouts = comm.inline_layouts(layout)
    for r, got in enumerate(layouts):
        if got is None:
            raise ValueError(f"cannot {op}-reduce: rank {r} holds more shared variables, or of more "
                             f"dimensions, than rank {comm.rank} does")
    agreed_layout([(list(got), 1.0) for got in layouts], op)
    raise RuntimeError(f"the processes' values of an inline {op}-reduce did not arrive")  # not reached


def reducers_for(n: int, cache, op, layout) -> tuple:
    """Per value of ``layout`` (``(dtype, shape)`` pairs), the Reducer of ``n``
    processes' parts (kept in ``cache``, ``proc.kept.reducers``), and whether its
    result must be cast to the value's dtype (an integer ``avg``)."""
    reducers = [reducer_of(cache, op, dtype, shape, n) for dtype, shape in layout]
    casts = [result_dtype(dtype, op) != dtype for dtype, _ in layout]
    return reducers, casts


def reduced(proc, op, parts, dtype) -> np.ndarray:
    """Every process's value (``parts``, in rank order) reduced with ``op`` into new
    memory (never a view of an area or a home), in ``dtype``: the master's
    ``reduce``, by the inline path or directly, with the same bits."""
    # (an ndarray also where the Reducer's scalar path gave a numpy scalar: a 0-d integer avg)
    return np.asarray(cast_to(kept_reducer(proc.kept.reducers, op, parts).run(parts), dtype))


def fold_into(homes, parts, reducers, casts) -> None:
    """Every process's values (``parts``, in rank order) reduced into ``homes``."""
    for i, home in enumerate(homes):
        out = reducers[i].run([p[i] for p in parts])  # new memory: home may be one of the parts
        np.copyto(home, cast_to(out, home.dtype) if casts[i] else out)
