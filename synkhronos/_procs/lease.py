"""The group's lock file (:class:`Lease`): the last one out knows it is last, a
rank's byte of it tells whether that rank lives, and a dead group's names are
reclaimed (:func:`unlink_stale`)."""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from typing import cast

from .shmem import SHM_DIR, LOCK_NAME, known_prefixes, new_prefix, unlink_prefix

__all__ = []

log = logging.getLogger("synkhronos")

#: struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (64-bit off_t).
_FLOCK = struct.Struct("hhqqi4x")


class Lease:
    """This process's hold on its group's lock file, ``<prefix>lock`` in /dev/shm.

    Every live process of the group holds a shared ``flock`` on it (through a
    descriptor of its own); the kernel drops it at death, however it comes, so
    the names are stale exactly when an exclusive lock can be taken (a pid is
    no proof: PID namespaces share /dev/shm). A process may also hold its
    rank's byte (``lockf``: never inherited, dropped at death)."""

    __slots__ = ("prefix", "fd")

    def __init__(self, prefix: str, create: bool = False):
        self.prefix = prefix
        path = os.path.join(SHM_DIR, prefix + LOCK_NAME)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)
        except OSError as err:  # a stale-name cleanup elsewhere took it between open and lock
            os.close(fd)
            raise OSError(f"the synkhronos lock file {path} was removed by another process") from err
        self.fd: int | None = fd  # None once closed

    @classmethod
    def new(cls) -> "Lease":
        """The lease of a new group, under a fresh prefix (created first, unlinked
        last), once the names of groups no longer alive are reclaimed."""
        stale = unlink_stale()
        if stale:
            log.info("removed %d shared-memory objects left by synkhronos processes no longer alive",
                     len(stale))
        error = None
        for _ in range(8):  # a stale-name cleanup elsewhere may catch it before it is locked
            try:
                return cls(new_prefix(), create=True)
            except OSError as err:
                error = err
        raise cast(OSError, error)  # (every try failed)

    def hold(self, rank: int) -> None:
        """Hold this process's rank byte (see the class docstring)."""
        fcntl.lockf(cast(int, self.fd), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)  # (not closed)

    def let_go(self, rank: int) -> None:
        """Drop this process's rank byte: the others now see it gone."""
        if self.fd is not None:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, rank)
            except OSError:
                pass

    def alive(self, rank: int) -> bool:
        """Whether the process of ``rank`` holds its byte (F_GETLK: a probe that took
        the byte, even for a moment, would make a second prober believe it alive)."""
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, rank, 1, 0)
        reply = fcntl.fcntl(cast(int, self.fd), fcntl.F_GETLK, query)  # (not closed)
        return _FLOCK.unpack(reply)[0] != fcntl.F_UNLCK

    def last_out(self) -> bool:
        """True when no other process holds the group's lock (this one may unlink);
        of several that ask at once one gets True (a failed try drops its lock)."""
        if self.fd is None:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def unlink_stale() -> list[str]:
    """Remove the names of groups none of whose processes is alive (a lock file that
    nobody holds); names without a lock file are left alone."""
    removed = []
    for prefix in known_prefixes():
        path = os.path.join(SHM_DIR, prefix + LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino != os.stat(path).st_ino:
                    continue
            except OSError:  # held: a process of that group is alive
                continue
            removed.extend(unlink_prefix(prefix))
        finally:
            os.close(fd)
    return removed


