"""A table stored once in POSIX shared memory, added to in place by every worker.

The table is a ``(num_row, num_col)`` array (an array table has one column)
in its own segment, after a small header of sync-server counters. Adds and
gets take the table's *stripe* locks: stripe ``s`` covers the rows
``[s * rows_per_stripe, (s + 1) * rows_per_stripe)`` (about
:data:`STRIPE_BYTES` each) and is guarded by one semaphore of the world's
pool. An add holds a stripe's lock while it adds into that stripe, so two
adds of the same element never interleave (no update is lost) and adds to
different stripes run at the same time. Each worker walks the stripes
starting from its own offset, so workers adding whole tables at once do not
queue on the same stripe.
"""

from __future__ import annotations

import numpy as np

from .._procs import shmem
from .._arrays import round_up
from .spmd import IN_SYNC_ADD, IN_SYNC_GET, describe_table

__all__ = ["ShmStore"]

#: Bytes per stripe (one lock each).
STRIPE_BYTES = 256 * 1024


class ShmStore:
    """One table's memory and locks on one machine.

    Args:
        world: the :class:`~.spmd.ForkedWorld`.
        index: the table's number (tables are made in the same order everywhere).
        num_row, num_col, dtype: the table's shape and element type.
        init_value: rank 0's initial value (flat, of the table's dtype) or None
            for zeros; the other ranks' values are ignored.

    Collective: every rank constructs it at the same time.
    """

    def __init__(self, world, index: int, num_row: int, num_col: int, dtype, init_value=None):
        self.world = world
        self.index = index
        self.shape = (num_row, num_col)
        self.dtype = np.dtype(dtype)
        n = world.size
        self._head = round_up(16 * n)
        nbytes = self._head + num_row * num_col * self.dtype.itemsize
        name = f"{world.prefix}t{index}"
        self.seg = None
        if world.rank == 0:
            self.seg = shmem.Segment(name, nbytes, create=True,
                                     what=f"a multiverso table of {num_row}x{num_col} {self.dtype}")
            if init_value is not None:
                self.seg.array(self.dtype, (num_row * num_col,), self._head)[:] = init_value
        meta = (index, num_row, num_col, self.dtype.num)
        try:
            metas = world.barrier(f"constructing table {index}", meta)
        except BaseException:
            self.close()
            raise
        for r, m in enumerate(metas):
            if m != meta:
                self.close()
                raise ValueError(
                    f"every worker must construct the same tables in the same order: table {index} "
                    f"is {describe_table(meta)} on worker {world.rank} but {describe_table(m)} on worker {r}")
        if self.seg is None:
            self.seg = shmem.Segment(name)
        self.data = self.seg.array(self.dtype, self.shape, self._head)
        self.arrived = self.seg.array(np.int64, (n,), 0)
        self.copied = self.seg.array(np.int64, (n,), 8 * n)
        row_bytes = max(1, num_col * self.dtype.itemsize)
        self.rows_per_stripe = max(1, STRIPE_BYTES // row_bytes)
        self.num_stripes = max(1, -(-num_row // self.rows_per_stripe))
        locks = world.stripe_locks
        self._locks = [locks[(index * 7919 + s) % len(locks)] for s in range(self.num_stripes)]
        self._start = world.rank * self.num_stripes // n

    def _order(self):
        s0, k = self._start, self.num_stripes
        return [(s0 + i) % k for i in range(k)]

    def _bounds(self, s):
        a = s * self.rows_per_stripe
        return a, min(a + self.rows_per_stripe, self.shape[0])

    # -- data ------------------------------------------------------------------

    def add(self, data: np.ndarray, rows: np.ndarray | None) -> None:
        """``table += data`` (all rows), or ``table[rows] += data`` (``rows`` sorted, unique)."""
        world = self.world
        if rows is None:
            for s in self._order():
                a, b = self._bounds(s)
                with world.locked(self._locks[s]):
                    np.add(self.data[a:b], data[a:b], out=self.data[a:b])
            return
        for s, sel in self._by_stripe(rows):
            r = rows[sel]
            with world.locked(self._locks[s]):
                self.data[r] += data[sel]

    def get(self, out: np.ndarray, rows: np.ndarray | None) -> None:
        """Copy all rows (or ``rows``, any order, repeats allowed) into ``out``."""
        world = self.world
        if rows is None:
            for s in self._order():
                a, b = self._bounds(s)
                with world.locked(self._locks[s]):
                    out[a:b] = self.data[a:b]
            return
        order = np.argsort(rows, kind="stable")
        srt = rows[order]
        for s, sel in self._by_stripe(srt):
            with world.locked(self._locks[s]):
                out[order[sel]] = self.data[srt[sel]]

    def _by_stripe(self, sorted_rows):
        """``(stripe, slice of sorted_rows)`` for each stripe that ``sorted_rows`` touch."""
        if len(sorted_rows) == 0:
            return
        stripes = sorted_rows // self.rows_per_stripe
        cuts = np.flatnonzero(np.diff(stripes)) + 1
        starts = np.concatenate(([0], cuts))
        stops = np.concatenate((cuts, [len(sorted_rows)]))
        for a, b in zip(starts.tolist(), stops.tolist()):
            yield int(stripes[a]), slice(a, b)

    # -- sync server -------------------------------------------------------------

    def before_get(self, count: int) -> None:
        """Sync server: wait until every worker still working issued its ``count``-th get."""
        world = self.world
        self.arrived[world.rank] = count
        world.wait_until(lambda: all(self.arrived[s] >= count or world.finished(s)
                                     for s in range(world.size)), "get() (sync server)",
                         (IN_SYNC_GET, (self.index << 32) | count))

    def after_get(self, count: int) -> None:
        self.copied[self.world.rank] = count

    def before_add(self, count: int) -> None:
        """Sync server: an add after this worker's ``count``-th get waits until every
        worker has taken its ``count``-th value, so that value never includes it."""
        world = self.world
        world.wait_until(lambda: all(self.copied[s] >= count or world.finished(s)
                                     for s in range(world.size)), "add() (sync server)",
                         (IN_SYNC_ADD, (self.index << 32) | count))

    def flush(self) -> None:
        """Every add is applied before it returns: nothing to wait for."""

    def close(self) -> None:
        self.data = self.arrived = self.copied = None  # type: ignore[assignment]  # closed: never used again
        if self.seg is not None:
            self.seg.close()  # rank 0 created it and unlinks it; the others only unmap
            self.seg = None

