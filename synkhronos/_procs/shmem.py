"""Named POSIX shared-memory segments, their names, and cleanup by prefix."""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import re
import secrets
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import posix_ipc

from .. import _state as state

__all__ = []

_SHM_DIR = "/dev/shm"
_ROOT = "synk"
# Names look like "synk.<owner pid>.<random token>.<what>"; whether they are
# stale is told by the fork's lock file (see Lease), not by the pid.
_NAME_RE = re.compile(r"^(?:sem\.)?synk\.(\d+)\.([0-9a-f]+)\.")
#: Scratch memory (a call's numpy inputs, slots, reduction results) of at least
#: this many bytes is reallocated to fit once SHRINK_AFTER uses in a row needed
#: less than a quarter of it: one large call does not keep its memory for the
#: rest of the run, and a call that alternates large and small collectives
#: does not reallocate at every one.
SHRINK_BYTES = 1 << 20
SHRINK_AFTER = 8
_I64 = struct.Struct("q")


def oversized(size: int, need: int) -> bool:
    """Whether scratch memory of ``size`` bytes is much too large for a use of ``need``
    (:class:`Shrink` counts such uses)."""
    return size >= SHRINK_BYTES and 4 * need < size


class Shrink:
    """Tells when a scratch segment that one large use left behind should be reallocated."""

    __slots__ = ("streak",)

    def __init__(self) -> None:
        self.streak = 0

    def __call__(self, size: int, need: int) -> bool:
        """Count one use of ``need`` bytes of ``size``; True when it is time to shrink."""
        if not oversized(size, need):
            self.streak = 0
            return False
        self.streak += 1
        if self.streak < SHRINK_AFTER:
            return False
        self.streak = 0
        return True


def new_prefix() -> str:
    """A fresh, unpredictable name prefix owned by this process."""
    return f"{_ROOT}.{os.getpid()}.{secrets.token_hex(8)}."


def _libc() -> tuple[Callable[..., Any], Callable[..., Any]]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long)
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc.mmap, libc.munmap


_libc_mmap, _libc_munmap = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """Shared memory mapped with ``mmap(2)`` through libc, holding no descriptor.

    Python's ``mmap.mmap`` keeps a duplicate of the descriptor open as long as
    the mapping lives (until Python 3.13's ``trackfd=False``): one descriptor
    per segment, so ``ulimit -n`` capped the number of segments. This maps
    without one. Every numpy array made from it (``__array_interface__``)
    holds it as its base, so the memory is unmapped when the last array, view
    or memoryview of it is gone, never while something can still reach it.
    """

    __slots__ = ("addr", "size")

    def __init__(self, fd: int, size: int):
        self.addr = None
        addr = _libc_mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping {size} bytes of shared memory failed: {os.strerror(err)}")
        self.addr, self.size = addr, size

    @property
    def __array_interface__(self) -> dict:
        return {"data": (self.addr, False), "shape": (self.size,), "typestr": "|u1", "version": 3}

    def __del__(self, _munmap: Callable[..., Any] = _libc_munmap) -> None:
        if self.addr is not None:
            _munmap(self.addr, self.size)


class Segment:
    """One named POSIX shared-memory segment mapped into this process.

    The creator owns the name and unlinks it; every other process only
    attaches and closes its mapping. A new segment's memory is reserved at
    once (see :func:`reserve`), so a full ``/dev/shm`` is a ``MemoryError``
    here rather than a ``SIGBUS`` when a page is first touched. No file
    descriptor stays open. Arrays from :meth:`array` stay valid after
    :meth:`close`; the memory is unmapped when the last of them is gone.
    """

    __slots__ = ("name", "size", "_map", "_mv", "owner")

    def __init__(self, name: str, size: int | None = None, create: bool = False, what: str = ""):
        self.name = name
        self.owner = create
        if create:
            size = max(int(cast(int, size)), 1)  # (a segment is created with its size)
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600)
            try:
                reserve(shm.fd, size, what or name)
            except BaseException:
                shm.close_fd()
                unlink_segment(name)
                raise
        else:
            shm = posix_ipc.SharedMemory("/" + name)
            size = shm.size
        try:
            self._map = np.asarray(_Mapping(shm.fd, size))
        except BaseException:
            if create:
                unlink_segment(name)
            raise
        finally:
            shm.close_fd()
        self._mv = memoryview(self._map)  # type: ignore[arg-type, unused-ignore]  # numpy < 2.5's stubs: a Buffer on 3.12+ only
        self.size = size

    def array(self, dtype: npt.DTypeLike, shape: Sequence[int], offset: int = 0) -> np.ndarray:
        """A numpy view of part of the segment (no copy)."""
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        return np.frombuffer(self._mv, dtype=dtype, count=count, offset=offset).reshape(shape)

    def buffer(self) -> memoryview:
        return self._mv

    def get_int(self, offset: int = 0) -> int:
        """The int64 at ``offset`` (cheaper than a numpy view for one number)."""
        return _I64.unpack_from(self._mv, offset)[0]

    def set_int(self, value: int, offset: int = 0) -> None:
        _I64.pack_into(self._mv, offset, value)

    def get_bytes(self, start: int, stop: int) -> bytes:
        return self._mv[start:stop].tobytes()

    def set_bytes(self, start: int, data: bytes) -> None:
        self._mv[start:start + len(data)] = data

    def close(self) -> None:
        """Drop this mapping (unmapped now, or when the last array of it is gone);
        unlink too when this process created the segment."""
        self._map = self._mv = None  # type: ignore[assignment]  # closed: never used again
        if self.owner:
            unlink_segment(self.name)
            self.owner = False


def free_space() -> tuple[int, int]:
    """``(free bytes, total bytes)`` of the shared-memory filesystem."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return -1, -1
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def reserve(fd: int, size: int, what: str) -> None:
    """Size a new segment and allocate its memory now (``posix_fallocate``).

    Memory of a shared-memory file is otherwise allocated when a page is first
    touched, and a full ``/dev/shm`` then kills the process with ``SIGBUS``.

    Raises:
        MemoryError: ``/dev/shm`` has less free space than ``size``; the
            message names the size, the free space and the remedy.
    """
    free, total = free_space()
    if 0 <= free < size:
        raise _full(size, free, total, what)
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            free, total = free_space()
            raise _full(size, free, total, what) from None
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        # a filesystem that cannot reserve: pages are allocated when touched, as before


def _full(size: int, free: int, total: int, what: str) -> MemoryError:
    race = " (other processes took the rest at the same time)" if free >= size else ""
    return MemoryError(
        f"not enough shared memory for {what}: it needs {_mib(size)}, but {_SHM_DIR} has "
        f"{_mib(max(free, 0))} free of {_mib(total)}{race}. Free some (drop synk.data objects, call "
        f"synk.close()) or make {_SHM_DIR} larger: in Docker, run with --shm-size "
        f"(for example --shm-size={max(1, -(-(total + size - free) // 2**30))}g); elsewhere, "
        f"remount it (mount -o remount,size=... {_SHM_DIR}).")


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(_SHM_DIR, name))


def unlink_segment(name: str) -> None:
    if state.foreign_prefixes and _is_foreign(name):
        return
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


def create_semaphore(name: str, initial: int = 0) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=0o600, initial_value=initial)


def open_semaphore(name: str, create: bool) -> posix_ipc.Semaphore:
    """Create semaphore ``name`` (at zero, this process its only owner), or open the existing one."""
    return create_semaphore(name) if create else posix_ipc.Semaphore("/" + name)


def close_semaphores(sems: Iterable[posix_ipc.Semaphore], unlink: bool) -> None:
    """Close every semaphore of ``sems``; unlink them too when ``unlink`` (their creator)."""
    for sem in sems:
        if unlink:  # before close(): posix_ipc refuses to unlink a closed semaphore
            try:
                sem.unlink()
            except posix_ipc.ExistentialError:
                pass
        try:
            sem.close()
        except posix_ipc.Error:
            pass


def _entries() -> list[str]:
    """The names in /dev/shm (segments as they are, semaphores as ``sem.NAME``)."""
    try:
        return os.listdir(_SHM_DIR)
    except OSError:
        return []


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment and semaphore whose name starts with ``prefix``.

    The fork's lock file goes last: while anything of a fork is left, so is
    its lock file, and :func:`unlink_stale` can judge it.
    """
    if state.foreign_prefixes and _is_foreign(prefix):
        return []
    removed = []
    lock = None
    for entry in _entries():
        if entry == prefix + LOCK_NAME:
            lock = entry
        elif entry.startswith(prefix):
            unlink_segment(entry)
            removed.append(entry)
        elif entry.startswith("sem." + prefix):
            try:
                posix_ipc.unlink_semaphore("/" + entry[4:])
            except posix_ipc.ExistentialError:
                pass
            removed.append(entry)
    if lock is not None:
        unlink_segment(lock)
        removed.append(lock)
    return removed


# -- which names belong to whom ---------------------------------------------

#: The lock file of a group is ``<prefix>lock`` in /dev/shm (see
#: :class:`synkhronos._procs.lease.Lease`, which holds it): it is unlinked last.
LOCK_NAME = "lock"
SHM_DIR = _SHM_DIR


def _is_foreign(name: str) -> bool:
    return any(name.startswith(p) for p in state.foreign_prefixes)


def disown(prefix: str) -> None:
    """Never unlink anything named ``prefix...`` from this process."""
    state.foreign_prefixes.add(prefix)


def known_prefixes() -> list[str]:
    """The prefixes of the synkhronos names in /dev/shm, each once."""
    seen: dict[str, None] = {}  # (a dict: the prefixes in the order found)
    for entry in _entries():
        m = _NAME_RE.match(entry)
        if m is not None:
            seen[f"{_ROOT}.{m.group(1)}.{m.group(2)}."] = None
    return list(seen)
