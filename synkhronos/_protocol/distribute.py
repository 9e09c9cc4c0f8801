"""distribute(): ship the master's functions and shared variables to the workers."""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import cast

import cloudpickle
from pytensor.compile.sharedvalue import SharedVariable

from .. import _state as state
from . import across_nodes as nodes
from .._state import interruptible
from .control import Command

__all__ = ["distribute"]


class _Pickler(cloudpickle.Pickler):
    """Pickles by value, except shared variables the workers already hold."""

    def __init__(self, file, known: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._known = known  # id(var) -> sid

    def persistent_id(self, obj):
        if isinstance(obj, SharedVariable):
            sid = self._known.get(id(obj))
            if sid is not None:
                return ("shared", sid)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, shareds: dict):
        super().__init__(file)
        self._shareds = shareds

    def persistent_load(self, pid):
        kind, sid = pid
        if kind != "shared" or sid not in self._shareds:
            raise pickle.UnpicklingError(f"unknown shared variable reference {pid!r}")
        return self._shareds[sid]


def shared_variables(lf) -> list:
    """The shared variables a function (its LocalFunction) reads or updates, in a stable order."""
    compiled = lf.compiled()
    out = [inp.variable for inp in compiled.maker.inputs if inp.shared]
    for var in lf.spec.sliceable:
        if all(v is not var for v in out):
            out.append(var)
    return out


def graph_digest(lf) -> str:
    """A digest of a function's compiled graph (its ops, types and shared
    variables' names and types, not their values): equal in every copy of a
    script that built the same function."""
    from pytensor.printing import debugprint  # the graph as text, ids in graph order

    text = cast(str, debugprint(lf.compiled(), file="str", print_type=True))  # (file="str": a str)
    return hashlib.sha256(text.encode()).hexdigest()


@state.serialized
def distribute() -> None:
    """Send every function built since the last distribute() to the workers.

    Functions are pickled together, with their shared variables (values as
    they are now), so variables shared between functions stay one variable in
    every worker; variables the workers already hold are sent by reference.
    Workers compile the functions at once, in parallel. Calling a function
    that was never distributed distributes it first.

    Args:
        None.

    Returns:
        None.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError: a function cannot be pickled (the message says which).
        Any exception a worker raised while unpickling or compiling.
    """
    s = state.running_session()
    s.usable()
    # the master's LocalFunctions, in creation order
    new = [lf for lf in s.proc.functions.values() if lf.spec.fid not in s.distributed]
    if not new:
        return
    known = dict(s.shared_ids)
    fresh: list[tuple[int, SharedVariable]] = []  # (sid, variable)
    for lf in new:
        for var in shared_variables(lf):
            if id(var) not in known and all(v is not var for _, v in fresh):
                fresh.append((len(s.shared_vars) + len(fresh) + 1, var))
    buf = io.BytesIO()
    try:
        _Pickler(buf, known).dump(([lf.spec for lf in new], fresh))
    except Exception as err:
        names = ", ".join(repr(lf.spec.name) for lf in new)
        raise TypeError(f"could not pickle functions {names} for the workers: {err}") from err
    # across nodes: every node must be distributing the same functions
    nodes.check_same_functions(s.proc, lambda: [(lf.spec.name, graph_digest(lf), lf.spec.output_modes
                                                  or lf.spec.output_ops, lf.spec.bcast) for lf in new])
    s.run(Command.DISTRIBUTE, buf.getvalue())
    for sid, var in fresh:
        s.shared_ids[id(var)] = sid
        s.shared_vars[sid] = var
        s.proc.shareds[sid] = var
    s.distributed.update(lf.spec.fid for lf in new)
    s.proc.device.place_shareds(s.proc)


def receive(proc, blob: bytes, make_local) -> None:
    """DISTRIBUTE in a worker: unpickle the functions and shared variables,
    compile each function with ``make_local(spec)`` (function.LocalFunction)."""
    specs, fresh = _Unpickler(io.BytesIO(blob), proc.shareds).load()
    for sid, var in fresh:
        proc.shareds[sid] = var
    for spec in specs:
        local = make_local(spec)
        with interruptible:  # compiling may take long: the master may give it up
            local.compiled()
        proc.functions[spec.fid] = local
    proc.device.place_shareds(proc)
