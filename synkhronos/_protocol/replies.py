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
    word 3   the version of the layout: the writer gives each layout a version
             of its own (never reused), the reader keeps its views per version
    then     per array: dtype character code, ndim, one word per dimension
"""

from __future__ import annotations

import numpy as np

from .._arrays import packed_views, round_up
from .._kept.records import Table

__all__ = ["ReplyArea", "ABSENT", "INLINE", "ELSEWHERE"]

ABSENT, INLINE, ELSEWHERE = 0, 1, 2
_ALIGN = 16


class ReplyArea:
    """One worker's reply area (a uint8 view of the control block), read and written in place.

    A loop of calls sends outputs of the same dtypes and shapes every time:
    the writer then leaves the header as it is, and the reader reuses the
    views it made for it. Word 3 names the layout: the writer gives each
    layout it writes a version of its own, kept, and the reader keeps its
    views per version, so a loop that alternates between functions (or
    outputs of several layouts) reparses nothing.
    """

    __slots__ = ("_buf", "_mv", "_words", "_weight", "_head", "_cap", "_layout", "_dst", "_layouts", "_versions",
                 "_version", "_views", "_seen")

    def __init__(self, area: np.ndarray):
        self._buf = area
        self._mv = memoryview(area)  # type: ignore[arg-type, unused-ignore]  # numpy < 2.5's stubs: a Buffer on 3.12+ only
        self._cap = area.nbytes
        self._words = area.view(np.int64)
        # the header's words one at a time: a memoryview reads and writes them
        # in a third of a numpy element access's time, on every call
        self._head = self._mv[:_HEAD * 8].cast("q")
        self._weight = self._mv[:_HEAD * 8].cast("d")  # word 1, the weight, as a float
        self._layout: tuple | None = None  # writer: the layout in the header now, and views where its arrays go
        self._dst: list[np.ndarray] = []
        self._layouts = Table(_MAX_LAYOUTS)     # writer: layout -> (its version, the views where its arrays go)
        self._versions = int(self._head[3])  # writer: the last version given (never given twice)
        self._version = -1     # reader: the header version its views were made for
        self._views: list[np.ndarray] = []
        self._seen = Table(_MAX_LAYOUTS)        # reader: version -> views, of the layouts read before

    def put(self, arrays, weight: float) -> bool:
        """Write ``arrays`` (numpy) and ``weight``; False, writing nothing, when they do not fit."""
        dst = self._dst
        if dst:
            if not _same_arrays(arrays, dst) and not self._switch(arrays):
                return False
        elif (arrays or self._layout != ()) and not self._switch(arrays):  # (after put_elsewhere: None)
            return False
        for a, view in zip(arrays, self._dst):  # the same dtype and shape: a plain copy
            view[...] = a
        self._weight[1] = weight
        self._head[0] = INLINE
        return True

    def _switch(self, arrays) -> bool:
        """Put the header of the layout of ``arrays`` in place, unless it is there
        already; False when they do not fit."""
        layout = tuple((a.dtype.char, a.shape) for a in arrays)
        if layout == self._layout:
            return True
        got = self._layouts.get(layout)
        if got is None:
            ends = _ends(arrays)
            if ends[-1] > self._cap:
                return False
            self._versions += 1
            # native byte order, as the reader takes the header's character codes
            dst = packed_views(self._buf, [(np.dtype(char), shape) for char, shape in layout], ends[0], _ALIGN)
            got = self._layouts.keep(layout, (self._versions, dst))
        self._write_header(layout, got[0])
        self._layout, self._dst = layout, got[1]
        return True

    def _write_header(self, layout, version: int) -> None:
        words, w = self._words, _HEAD
        for char, shape in layout:
            words[w] = ord(char)
            words[w + 1] = len(shape)
            words[w + 2:w + 2 + len(shape)] = shape
            w += 2 + len(shape)
        words[2] = len(layout)
        words[3] = version

    def put_absent(self) -> None:
        self._head[0] = ABSENT

    def put_elsewhere(self, generation: int) -> None:
        self._layout, self._dst = None, []  # word 2 no longer holds the count
        self._head[2] = generation
        self._head[0] = ELSEWHERE

    def state(self) -> int:
        return self._head[0]

    def generation(self) -> int:
        """The segment generation of an ELSEWHERE reply."""
        return self._head[2]

    def inline(self):
        """``(arrays, weight)`` of an INLINE reply: views of the area (no copy),
        the very list again while the layout stays; None for any other state."""
        head = self._head
        if head[0] != INLINE:
            return None
        version = head[3]
        if version != self._version:
            views = self._seen.get(version)
            if views is None:
                views = self._seen.keep(version, self._read_views())
            self._views, self._version = views, version
        return self._views, self._weight[1]

    def _read_views(self) -> list:
        words = self._words
        layout, w = [], _HEAD
        for _ in range(int(words[2])):
            ndim = int(words[w + 1])
            layout.append((np.dtype(chr(words[w])), tuple(int(d) for d in words[w + 2:w + 2 + ndim])))
            w += 2 + ndim
        return packed_views(self._buf, layout, round_up(w * 8, _ALIGN), _ALIGN)


#: Layouts a reply area's writer and reader keep (each starts again past this many).
_MAX_LAYOUTS = 64


def _same_arrays(arrays, views) -> bool:
    """Whether ``arrays`` have the dtypes (the very dtype objects, as a loop of
    calls gives them) and shapes of ``views``, the writer's views for the
    header in place: its quick check; False sends it to the full comparison."""
    if len(arrays) != len(views):
        return False
    for a, v in zip(arrays, views):
        if a.dtype is not v.dtype or a.shape != v.shape:
            return False
    return True


#: Words before the layout: state, weight, count, header version.
_HEAD = 4


def _ends(arrays) -> list:
    """Where the data of each array starts, then where the last one ends (bytes)."""
    head = _HEAD + sum(2 + a.ndim for a in arrays)
    offsets = [round_up(head * 8, _ALIGN)]
    for a in arrays:
        offsets.append(round_up(offsets[-1] + a.nbytes, _ALIGN))
    return offsets
