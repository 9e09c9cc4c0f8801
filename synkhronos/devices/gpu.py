"""The GPU device: one GPU per process, functions in PyTensor's JAX mode,
shared variables kept on the device, NCCL when every process has a GPU of
its own.

CuPy and JAX are imported only once a process opens its GPU (after fork).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
import weakref
from typing import cast

import numpy as np

from .._arrays import buffer_range, concat, is_device_array, join, span_overlaps, to_jax, to_numpy
from ..collectives import BACKENDS, Communicator
from ..collectives.nccl import new_unique_id
from ..collectives.ops import cast_to
from .._protocol.control import Command
from ..errors import user_stacklevel
from . import gpu_stack
from .base import Device
from .jax_state import jax_linker

__all__ = ["GpuDevice"]

log = logging.getLogger("synkhronos")

#: Shared-variable collectives that go through NCCL when there is an NCCL communicator.
_NCCL_KINDS = ("broadcast", "gather", "all_gather", "reduce", "all_reduce")


class GpuState:
    """What one process holds of its GPU: the JAX device and the CuPy device."""

    def __init__(self):
        import cupy
        import jax

        devices = jax.devices()
        if not devices or devices[0].platform not in ("gpu", "cuda"):
            raise RuntimeError(f"JAX found no CUDA device (its devices: {devices}); "
                               f"install JAX with CUDA: {gpu_stack.INSTALL_HINT}")
        self.jax_device = devices[0]
        self.cupy_device = cupy.cuda.Device(0)
        self.cupy_device.use()
        self.placed: dict = {}   # sid -> shared variable kept on the device

    def describe(self) -> str:
        return f"{self.jax_device} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"


@dataclasses.dataclass
class OpenDevice:
    """The INIT_DEVICE command: first every process opens its GPU, then NCCL."""

    phase: str                  # "device" or "nccl"
    unique_id: bytes | None = None


def _open(proc, msg: OpenDevice) -> None:
    proc.device.open(proc, msg)


class GpuDevice(Device):
    """Each process on GPU ``rank % n_gpus`` (see :class:`gpu_stack.GpuPlan`)."""

    name = "gpu"
    default_mode = "JAX"   # the graph runs on this process's GPU
    keeps_values_on_device = True

    def __init__(self, plan: gpu_stack.GpuPlan):
        self.plan = plan
        self.state: GpuState | None = None   # once this process opened its GPU
        self.comm: Communicator | None = None  # NcclCommunicator when every process has a GPU of its own

    @classmethod
    def units(cls, required: bool) -> int:
        return gpu_stack.require_gpu() if required else gpu_stack.auto_gpus()

    @classmethod
    def create(cls, units: int, n_parallel: int, master_rank: int) -> "GpuDevice":
        if n_parallel > units:
            warnings.warn(f"n_parallel={n_parallel} is more than the {units} GPUs visible; processes "
                          "will share GPUs and use the CPU (shared-memory) collectives",
                          stacklevel=user_stacklevel())
        device = cls(gpu_stack.plan(units, n_parallel))
        device.plan.saved_env = gpu_stack.bind(device.plan, master_rank, n_parallel)
        return device

    def bind(self, rank: int) -> None:
        gpu_stack.bind(self.plan, rank)

    def unbind(self) -> None:
        gpu_stack.unbind(self.plan.saved_env)

    # -- opening the GPU in every process ----------------------------------

    def start(self, session) -> None:
        session.run(Command.INIT_DEVICE, OpenDevice("device"), _open)
        if self.plan.nccl:
            session.run(Command.INIT_DEVICE, OpenDevice("nccl", new_unique_id()), _open)

    def open(self, proc, msg: OpenDevice) -> None:
        if msg.phase == "device":
            self.state = GpuState()
            log.debug("rank %d uses %s", proc.rank, self.state.describe())
        elif msg.phase == "nccl":
            self.comm = BACKENDS["nccl"](proc.comm, msg.unique_id)
        else:
            raise ValueError(f"unknown INIT_DEVICE phase {msg.phase!r}")

    # -- shared variables on the device ------------------------------------

    def place_shareds(self, proc) -> None:
        """Move to the device the shared variables that only JAX-mode functions use.

        Variables also read by a function of another mode (C, Python, Numba) stay
        in host memory, where those functions expect them.
        """
        if self.state is None:
            return
        on_jax: set[int] = set()
        elsewhere: set[int] = set()
        for lf in proc.functions.values():
            fn = lf.compiled()
            used = {id(inp.variable) for inp in fn.maker.inputs if inp.shared}
            used |= {id(v) for v in lf.spec.sliceable}
            (on_jax if jax_linker(getattr(fn.maker, "linker", None)) else elsewhere).update(used)
        for sid, var in proc.shareds.items():
            if id(var) in on_jax and id(var) not in elsewhere:
                self.state.placed[sid] = var
        self.keep_on_device(proc)

    def keep_on_device(self, proc) -> None:
        """Put back on the device any placed shared variable whose value is in host memory
        (after ``set_value``, a CPU collective, or updates accumulated over slices)."""
        if self.state is None or not self.state.placed:
            return
        for var in self.state.placed.values():
            value = var.container.storage[0]
            if isinstance(value, np.ndarray):  # (JAX imported only then: this runs twice per call)
                import jax

                # straight into the storage: set_value would filter it back to numpy
                var.container.storage[0] = jax.device_put(value, self.state.jax_device)

    def _assign_on_device(self, sid, var, value) -> None:
        """Make ``value`` (a CuPy array) the value of ``var``: on the device for a placed
        variable, in host memory for the others."""
        value = cast_to(value, var.type.dtype)  # rounded into integers, never truncated
        if sid in cast(GpuState, self.state).placed:  # (the NCCL paths run once the GPU is open)
            var.container.storage[0] = to_jax(value)
        else:
            var.set_value(to_numpy(value), borrow=True)

    def placement(self, proc, sids) -> np.ndarray:
        return np.array([is_device_array(proc.shareds[sid].container.storage[0]) for sid in sids])

    def shared_collective(self, proc, spec, host_run):
        """A collective on shared variables in a GPU process.

        Through NCCL, on the values where they are, when every process has a GPU
        of its own; otherwise (shared GPUs, a ``c_`` op, scatter, set_value,
        get_value, get_shapes) through ``host_run``, the CPU path: values go to
        host memory and the placed ones back to the device afterwards. The
        master gets numpy arrays back either way.
        """
        if self.state is None:
            return host_run(proc, spec)
        try:
            if self.comm is None or spec.kind not in _NCCL_KINDS or spec.cpu:
                return host_run(proc, spec)
            return _NCCL_COLLECTIVES[spec.kind](self, proc, spec)
        finally:
            self.keep_on_device(proc)  # also a value the master was given (broadcast, set_value)

    def _nccl(self) -> Communicator:
        """The NCCL communicator (:meth:`shared_collective` takes the NCCL paths only once it is open)."""
        return cast(Communicator, self.comm)

    def _assign_all(self, spec, vars_, got) -> None:
        for sid, v, g in zip(spec.sids, vars_, got):
            self._assign_on_device(sid, v, g)

    def _nccl_broadcast(self, proc, spec):
        vars_, values = _values(proc, spec)
        got = self._nccl().broadcast(values if proc.is_master else None, root=proc.master_rank)
        if not proc.is_master:
            self._assign_all(spec, vars_, got)

    def _nccl_gather(self, proc, spec):
        vars_, values = _values(proc, spec)
        return self._nccl().gather(values, root=proc.master_rank, join=lambda i, parts: join(
            [to_numpy(p) for p in parts], spec.nd_up, vars_[i]))

    def _nccl_all_gather(self, proc, spec):
        vars_, values = _values(proc, spec)
        got = self._nccl().all_gather(values, join=lambda i, parts: concat(parts))
        self._assign_all(spec, vars_, got)
        return [to_numpy(g) for g in got] if proc.is_master else None

    def _nccl_reduce(self, proc, spec):
        vars_, values = _values(proc, spec)
        got = self._nccl().reduce(values, spec.op, root=proc.master_rank)
        if got is not None and proc.is_master:
            if spec.in_place:
                self._assign_all(spec, vars_, got)
            return [cast_to(to_numpy(g), v.type.dtype) for g, v in zip(got, vars_)]
        return None

    def _nccl_all_reduce(self, proc, spec):
        """In place on the values' own device buffers where NCCL can (see
        :meth:`.NcclCommunicator.all_reduce`): a placed variable of its own dtype
        whose value no other shared variable holds (JAX may hand one array to two
        variables: ``updates=[(b, a)]``). Only the results that are new arrays
        are assigned."""
        vars_, values = _values(proc, spec)
        held_twice = _held_twice(proc.shareds.values())
        placed = cast(GpuState, self.state).placed
        in_place = [sid in placed and id(value) not in held_twice and value.dtype == var.type.dtype
                    for sid, var, value in zip(spec.sids, vars_, values)]
        got = self._nccl().all_reduce(values, spec.op, in_place=in_place)
        for sid, var, value, result in zip(spec.sids, vars_, values, got):
            if result is not value:
                self._assign_on_device(sid, var, result)

    # -- outputs -----------------------------------------------------------

    def guarded(self, proc, inputs, kept: dict | None = None) -> tuple | None:
        """``(ranges, values)``: the memory (``(low, high)`` ranges) of the call's inputs
        and of every shared variable's value before the call, and those values (an output
        may be one of them, or a view of one: JAX forwards inputs to outputs,
        ``outputs=x``, ``updates=[(b, a)]``).

        ``kept`` (a planned call's): the ranges of the shared values that are device
        arrays, kept by the very array (a weak reference) from the last call. Valid
        while that array lives: a device array's buffer never moves (JAX arrays are
        immutable; one deleted since holds no memory, so its old range can only
        refuse a write). Rebuilt at every call from that call's values."""
        if self.state is None or self.comm is None:
            return None
        values = [var.container.storage[0] for var in proc.shareds.values()]
        if kept is None:
            return _ranges([*inputs, *values]), values
        return _ranges(inputs) + _kept_ranges(values, kept), values

    def writable_outputs(self, proc, outs, idx, guarded) -> list | None:
        """Per output ``outs[i]`` of ``idx``: whether NCCL may reduce it in place, on its own
        buffer: a device array sharing no byte with the ``guarded`` memory, with a shared
        variable's new value (an update), or with another output (one array may be two
        outputs). NCCL itself then checks that the array may be written
        (:func:`writable_in_place`: no cached host copy) and that it reduces it in its dtype."""
        if guarded is None:
            return None
        taken, before = guarded
        new = [var.container.storage[0] for var in proc.shareds.values()]
        taken = taken + _ranges(v for v, old in zip(new, before) if v is not old)
        spans = [buffer_range(o) for o in outs]
        writable = []
        for i in idx:
            span = spans[i]
            ok = span is not None and span[1] - span[0] < 1 << 63
            if ok:
                ok = not span_overlaps(span, taken + [s for j, s in enumerate(spans) if j != i and s is not None])
            writable.append(ok)
        return writable

    def to_user(self, results, device_outputs: bool) -> list:
        """The master's outputs: numpy arrays (writable, of their own memory), or JAX arrays
        on this GPU with ``device_outputs`` (the very arrays the reduction wrote in place)."""
        if self.state is None:
            return results
        if device_outputs:
            return [None if r is None else to_jax(r, self.state.jax_device) for r in results]  # (JAX arrays as they are)
        out = [to_numpy(r) for r in results]
        # a JAX array's host value is read-only (and on the CPU its very buffer): a copy of its own
        return [r.copy() if isinstance(r, np.ndarray) and not r.flags.writeable else r for r in out]


def _ranges(values) -> list:
    """The ``(low, high)`` memory ranges of those of ``values`` that hold memory."""
    return [r for r in map(buffer_range, values) if r is not None]


def _kept_ranges(values, kept: dict) -> list:
    """:func:`_ranges` of ``values``, reading those of device arrays from ``kept``
    (``id -> (weak reference, range)``) where the very array is there; ``kept`` then
    holds the device arrays of ``values``, and only those."""
    ranges, now = [], {}
    for v in values:
        got = kept.get(id(v))
        if got is not None and got[0]() is v:
            r = got[1]
            now[id(v)] = got
        else:
            r = buffer_range(v)
            if is_device_array(v):
                try:
                    now[id(v)] = (weakref.ref(v), r)
                except TypeError:  # (an array type without weak references: read every time)
                    pass
        if r is not None:
            ranges.append(r)
    kept.clear()
    kept.update(now)
    return ranges


def _held_twice(variables) -> set:
    """The ids of the values that more than one of these shared variables holds."""
    seen: set = set()
    twice: set = set()
    for var in variables:
        i = id(var.container.storage[0])
        (twice if i in seen else seen).add(i)
    return twice


def _values(proc, spec):
    vars_ = [proc.shareds[sid] for sid in spec.sids]
    return vars_, [v.container.storage[0] for v in vars_]


#: kind -> the NCCL path of that shared-variable collective.
_NCCL_COLLECTIVES = {
    "broadcast": GpuDevice._nccl_broadcast,
    "gather": GpuDevice._nccl_gather,
    "all_gather": GpuDevice._nccl_all_gather,
    "reduce": GpuDevice._nccl_reduce,
    "all_reduce": GpuDevice._nccl_all_reduce,
}
