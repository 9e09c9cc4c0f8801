"""Named POSIX shared-memory segments, their names, and cleanup by prefix."""

from __future__ import annotations

import math
import mmap
import os
import re
import secrets
import struct

import numpy as np
import posix_ipc

__all__ = []

_SHM_DIR = "/dev/shm"
_ROOT = "synk"
# Names look like "synk.<owner pid>.<random token>.<what>"; the owner pid lets
# a later fork() find what a killed master left behind.
_NAME_RE = re.compile(r"^(?:sem\.)?synk\.(\d+)\.([0-9a-f]+)\.")
_ALIGN = 64
_I64 = struct.Struct("q")


def new_prefix() -> str:
    """A fresh, unpredictable name prefix owned by this process."""
    return f"{_ROOT}.{os.getpid()}.{secrets.token_hex(8)}."


def _round_up(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


class Segment:
    """One named POSIX shared-memory segment mapped into this process.

    The creator owns the name and unlinks it; every other process only
    attaches and closes its mapping.
    """

    __slots__ = ("name", "size", "_map", "owner")

    def __init__(self, name: str, size: int | None = None, create: bool = False):
        self.name = name
        self.owner = create
        if create:
            size = max(int(size), 1)
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
        else:
            shm = posix_ipc.SharedMemory("/" + name)
            size = shm.size
        try:
            self._map = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.size = size

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        """A numpy view of part of the segment (no copy)."""
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def buffer(self) -> memoryview:
        return memoryview(self._map)

    def get_int(self, offset: int = 0) -> int:
        """The int64 at ``offset`` (cheaper than a numpy view for one number)."""
        return _I64.unpack_from(self._map, offset)[0]

    def set_int(self, value: int, offset: int = 0) -> None:
        _I64.pack_into(self._map, offset, value)

    def get_bytes(self, start: int, stop: int) -> bytes:
        return self._map[start:stop]

    def set_bytes(self, start: int, data: bytes) -> None:
        self._map[start:start + len(data)] = data

    def close(self) -> None:
        """Unmap; unlink too when this process created the segment."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # numpy views still point into the mapping; the OS unmaps it
                # when they are gone, the name can go now all the same.
                pass
            self._map = None
        if self.owner:
            unlink_segment(self.name)
            self.owner = False


def unlink_segment(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


def create_semaphore(name: str, initial: int = 0) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=0o600, initial_value=initial)


def _entries() -> list[str]:
    """The names in /dev/shm (segments as they are, semaphores as ``sem.NAME``)."""
    try:
        return os.listdir(_SHM_DIR)
    except OSError:
        return []


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment and semaphore whose name starts with ``prefix``."""
    removed = []
    for entry in _entries():
        if entry.startswith(prefix):
            unlink_segment(entry)
            removed.append(entry)
        elif entry.startswith("sem." + prefix):
            try:
                posix_ipc.unlink_semaphore("/" + entry[4:])
            except posix_ipc.ExistentialError:
                pass
            removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unlink_stale() -> list[str]:
    """Remove segments and semaphores left by synkhronos masters now dead."""
    removed = []
    for entry in _entries():
        m = _NAME_RE.match(entry)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        removed.extend(unlink_prefix(f"{_ROOT}.{pid}.{m.group(2)}."))
    return removed


def round_up(n: int) -> int:
    return _round_up(n)
