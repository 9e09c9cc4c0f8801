"""Launchers and MPI: whether a launcher started this process (:func:`launched`),
the one bootstrap of MPI (:func:`mpi`), and :class:`Notices`, the one failure
channel between MPI processes."""

from __future__ import annotations

import ctypes
import functools
import os
import pickle
import threading
import warnings

import numpy as np

from .. import _state
from .waits import wait_until

__all__ = []

#: Environment variables a launcher sets in every copy it starts (Open MPI,
#: MPICH/Hydra and Intel MPI, PMIx and PMI-2 launchers, ``srun --mpi=...``).
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK")
#: ``SYNKHRONOS_NODES=0`` keeps a launched copy to itself (no MPI at all).
SWITCH = "SYNKHRONOS_NODES"


def launched() -> bool:
    """Whether an MPI launcher started this process (and joining is not switched off)."""
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "no", "false", "off"):
        return False
    return any(os.environ.get(v) for v in LAUNCHER_VARS)


@functools.cache
def _import_mpi4py():
    """mpi4py's ``MPI`` module, imported without initialising MPI (the one import of it)."""
    try:
        import mpi4py
    except ImportError as err:
        found = [v for v in LAUNCHER_VARS if os.environ.get(v)]
        raise ImportError(f"synkhronos: an MPI launcher started this process ({', '.join(found) or 'MPI'} "
                          "is set), and joining the other copies needs mpi4py: pip install "
                          "'synkhronos[mpi]' (mpi4py for the site's MPI) or 'synkhronos[mpi-wheel]' "
                          f"(with Open MPI's wheel); or set {SWITCH}=0 to run each copy on its "
                          "own") from err

    mpi4py.rc.initialize = False  # initialised below, after any fork; never at import
    mpi4py.rc.finalize = False    # finalised by its user, after what it allocated is freed
    from mpi4py import MPI  # only here: importing the package never imports mpi4py

    return MPI


class _Start:
    """MPI_Init, run in a thread of its own: it returns only once every copy of the
    job has called it, so a copy still loading its data (or one that never calls
    it) would hold this one inside C for as long as it lives, deaf to signals and
    to any timeout. The caller's thread waits instead, in Python. Its state is
    ``_state.mpi_start``.

    mpi4py's ``Init_thread`` keeps the GIL while MPI_Init waits (the waiting
    thread could not run), so the thread calls MPI's C function through ctypes,
    which lets the GIL go, then makes MPI's errors exceptions as mpi4py's own
    start does. Where MPI's library cannot be found, mpi4py's call is made in
    the caller's thread (without a bound)."""

    @staticmethod
    def library():
        """MPI's shared library loaded with mpi4py (None if not found)."""
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "/libmpi" in line and ".so" in line}
        except OSError:
            return None
        for path in sorted(paths):
            if os.path.basename(path).startswith(("libmpi.so", "libmpich.so", "libmpi_mt.so")):
                try:
                    lib = ctypes.CDLL(path)
                    lib.MPI_Init_thread  # noqa: B018 - present?
                    return lib
                except (OSError, AttributeError):
                    continue
        return None

    @staticmethod
    def run(lib, required: int, state: dict) -> None:
        try:
            provided = ctypes.c_int(0)
            code = lib.MPI_Init_thread(None, None, ctypes.c_int(required), ctypes.byref(provided))
            if code != 0:
                state["error"] = RuntimeError(f"MPI_Init_thread failed with MPI error code {code}")
            state["provided"] = provided.value
        except BaseException as err:  # noqa: BLE001 - raised in the waiting thread
            state["error"] = err


def mpi(timeout: float | None = None, check=None):
    """mpi4py's ``MPI`` module, MPI initialised (``THREAD_SERIALIZED``) at the first call.

    Many MPI transports break in a process that forks after ``MPI_Init``: call
    it only once every fork is done. Finalising is the caller's.

    MPI_Init runs in a thread of its own; the calling thread waits for it,
    calling ``check()`` between slices (signals are handled meanwhile), for at
    most ``timeout`` seconds (None: as long as it takes).

    Raises:
        ImportError: mpi4py is not installed (the message says what to install).
        TimeoutError: MPI did not start within ``timeout`` (the other copies of
            the job had not all called it); a later call waits again.
    """
    MPI = _import_mpi4py()
    st = _state.mpi_start
    if st["ours"] is None and st["thread"] is None:
        if MPI.Is_initialized():
            st["ours"] = False
        else:
            lib = _Start.library()
            if lib is None:
                MPI.Init_thread(MPI.THREAD_SERIALIZED)
                st["ours"] = True
                return MPI
            st["thread"] = started = threading.Thread(target=_Start.run, args=(lib, MPI.THREAD_SERIALIZED, st),
                                                      name="synkhronos-mpi-init", daemon=True)
            started.start()
    thread = st["thread"]
    if thread is not None:
        if not wait_until(lambda: not thread.is_alive(), check, timeout=timeout, max_sleep=0.01):
            raise TimeoutError(f"MPI_Init did not complete within {timeout} s")
        if st["error"] is not None:
            raise st["error"]
        if st.get("provided", MPI.THREAD_SERIALIZED) < MPI.THREAD_SERIALIZED:
            # (MPI's own level: FUNNELED would allow calls from MPI_Init's thread only)
            warnings.warn(f"synkhronos: this MPI gives thread level {st['provided']}, below "
                          "MPI_THREAD_SERIALIZED, which synkhronos asks for (MPI_Init ran in a thread "
                          "of its own; MPI is then called from the main thread)", stacklevel=2)
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):  # as mpi4py's own start: errors raise
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        st["thread"], st["ours"] = None, True
    return MPI


def mpi_started_here() -> bool:
    """Whether :func:`mpi` initialised MPI (rather than the script, before it)."""
    mpi()
    return bool(_state.mpi_start["ours"])


class Notices:
    """The failure channel between the processes of an MPI communicator ``comm``
    (a duplicate it owns): a process that fails sends one notice to every other,
    which find it with :meth:`received` between polls. Never a blocking call."""

    TAG = 7

    def __init__(self, comm, limit: int):
        MPI = mpi()
        self.comm = comm
        self.limit = limit
        self._buf = np.zeros(limit, dtype=np.uint8)
        self._recv = comm.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=self.TAG)
        self._got = None
        self.sent: list = []  # (buffers, requests): MPI may use the buffers until close()

    def send(self, value, shorter) -> None:
        """Send ``value`` to every other process; ``shorter(value)`` stands in for a
        value that pickles to more than ``limit`` bytes."""
        blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        if len(blob) > self.limit:
            blob = pickle.dumps(shorter(value), protocol=pickle.HIGHEST_PROTOCOL)[:self.limit]
        buf = np.frombuffer(blob, dtype=np.uint8)
        self.sent.append((buf, self.to_others(buf, self.TAG)))

    def to_others(self, buf, tag: int) -> list:
        """Non-blocking sends of ``buf`` to every other process (one already gone is skipped)."""
        MPI, comm = mpi(), self.comm
        reqs = []
        for r in range(comm.Get_size()):
            if r != comm.Get_rank():
                try:
                    reqs.append(comm.Isend([buf, MPI.BYTE], dest=r, tag=tag))
                except Exception:  # noqa: BLE001 - a process already gone needs no notice
                    pass
        return reqs

    def received(self, unreadable=None):
        """The notice another process sent, once it has arrived (None until then;
        ``unreadable`` for one that does not unpickle)."""
        if self._got is None and self._recv is not None and self._recv.Test():
            self._recv = None
            try:
                self._got = pickle.loads(self._buf.tobytes())
            except Exception:  # noqa: BLE001 - a cut notice names nothing better
                self._got = unreadable
        return self._got

    def close(self) -> None:
        """Cancel the receive, give the sends a moment, free the communicator."""
        MPI = mpi()
        try:
            if self._recv is not None and not self._recv.Test():
                self._recv.Cancel()
                wait_until(self._recv.Test, timeout=5.0, spin=0.0)
        except Exception:  # noqa: BLE001 - unusable after a failure: local release only
            pass
        reqs = [r for _, sent in self.sent for r in sent]
        try:
            wait_until(lambda: MPI.Request.Testall(reqs), timeout=1.0, spin=0.0)
        except Exception:  # noqa: BLE001
            pass
        self._recv = None
        self.sent = []
        try:
            self.comm.Free()
        except Exception:  # noqa: BLE001 - freed or unusable after a failure
            pass
