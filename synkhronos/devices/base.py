"""The Device interface: every decision that depends on where a process computes."""

from __future__ import annotations

import numpy as np

from ..collectives import BACKENDS, Communicator

__all__ = ["Device"]


class Device:
    """What a fork computes on, one instance per process (``proc.device``).

    fork() makes the master's (:func:`synkhronos.devices.create`); workers
    inherit it through ``os.fork`` and bind themselves with it. The defaults
    are those of a device that keeps everything in host memory.
    """

    #: What ``fork(device=...)`` names.
    name = "?"
    #: The ``collectives.BACKENDS`` key of the host-memory communicator.
    host_backend = "shm"
    #: The device communicator (GPU: NCCL when every process has a GPU of its own), or None.
    comm: Communicator | None = None
    #: synk.function's default PyTensor mode on this device (None: PyTensor's own).
    default_mode: str | None = None
    #: on_device() is allowed: shared-variable values may stay on the device.
    keeps_values_on_device = False

    @classmethod
    def units(cls, required: bool) -> int:
        """How many devices of this kind may be used (0: none, or use the cores);
        with ``required``, none raises RuntimeError naming the fix."""
        return 0

    @classmethod
    def create(cls, units: int, n_parallel: int, master_rank: int) -> "Device":
        """The master's device, bound to its unit before anything touches it."""
        return cls()

    def bind(self, rank: int) -> None:
        """In a new worker, first thing: take this rank's unit."""

    def unbind(self) -> None:
        """In the master at close(): undo what :meth:`create` bound."""

    def open_host_comm(self, proc, create: bool):
        """The host-memory communicator of ``proc`` (made by the master with ``create``)."""
        check = proc.check_master if not proc.is_master else (lambda: None)
        return BACKENDS[self.host_backend](proc.prefix, proc.rank, proc.size, proc.master_rank,
                                           create=create, check=check)

    def start(self, session) -> None:
        """In the master right after fork: open the device in every process."""

    def open(self, proc, msg) -> None:
        """In every process: the INIT_DEVICE command's work."""
        raise ValueError(f"the {self.name} device has nothing to open (got {msg!r})")

    def comm_for(self, proc, cpu: bool):
        """The communicator of a function output or collective: the device's
        unless ``cpu`` asks for the host path or there is none."""
        return proc.comm if cpu or self.comm is None else self.comm

    def place_shareds(self, proc) -> None:
        """After distribute: move to the device the shared variables that belong there."""

    def keep_on_device(self, proc) -> None:
        """Before and after a call: put placed values back on the device."""

    def shared_collective(self, proc, spec, host_run):
        """A collective on shared variables in this process (``host_run``: the host path)."""
        return host_run(proc, spec)

    def placement(self, proc, sids) -> np.ndarray:
        """Per variable of ``sids``, whether this process holds its value on the device."""
        return np.zeros(len(sids), dtype=bool)

    def guarded(self, proc, inputs, kept: dict | None = None) -> tuple | None:
        """Before a call's share runs in the master: the memory its outputs' reduction
        must never write into (see :meth:`writable_outputs`); None: it writes into none.
        ``kept``: a dict a planned call keeps for it from call to call."""
        return None

    def writable_outputs(self, proc, outs, idx, guarded) -> list | None:
        """Per output ``outs[i]`` of ``idx``, whether its reduction may write the result
        into the output's own buffer; None: into none."""
        return None

    def to_user(self, results, device_outputs: bool) -> list:
        """The master's outputs as the user gets them."""
        return results

    def close(self) -> None:
        """Release the device communicator of this process."""
        if self.comm is not None:
            self.comm.close()
            self.comm = None
