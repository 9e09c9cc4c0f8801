"""The homes of shared variables: the shared-memory arrays where each process keeps
the values of the variables a collective reads or writes, so that others read them in place."""

from __future__ import annotations

import numpy as np

from .._arrays import byte_bounds, overlaps
from ..collectives.ops import cast_to

__all__ = []


def assign(var, value) -> None:
    # a reduction's float result lands in an integer variable rounded, never truncated
    var.set_value(cast_to(np.asarray(value), var.type.dtype), borrow=True)


#: Shared-memory homes kept per shared variable. PyTensor may give the old
#: storage of an updated shared variable to another one (in-place ops on an
#: update target): that home is then skipped, never written, until the other
#: variable lets it go. Two homes alternate in a training loop; a third is spare.
#: Only shared variables of distributed functions are checked: a plain
#: master-only PyTensor function that updates a distributed variable together
#: with one no synkhronos function uses could hand that one a home unnoticed.
_HOMES = ("", "b", "c")


def _home(proc, sid, dtype, shape, taken, current=None) -> np.ndarray:
    """A shared-memory array for variable ``sid`` that no other shared variable uses.

    ``current``, if it is one of its homes, is still the variable's value: no
    other variable can have been given it (PyTensor gives away only the old
    storage of a variable it updates, which then holds something else).
    Otherwise the first home that no other shared variable uses; ``taken()``
    lists the memory they use, computed only then. A home is made only when
    every one before it is taken (most variables never need a second), and
    homes of another shape or dtype are given up.
    """
    comm = proc.comm
    first = comm.existing(f"sv{sid}", dtype, shape)
    if current is not None and current is first:  # the usual case: a single home, still the value
        return current
    keys = [f"sv{sid}{h}" for h in _HOMES]
    homes = [first, *(comm.existing(key, dtype, shape) for key in keys[1:])]
    if current is not None and any(current is h for h in homes):
        return current
    ranges, free_key = None, None
    for key, view in zip(keys, homes):
        if view is None:
            free_key = free_key or key
            continue
        if not view.nbytes:
            return view
        if ranges is None:
            ranges = taken()
        if not overlaps(view, ranges):
            return view
    if free_key is None:
        return comm.resident(keys[-1], dtype, shape, fresh=True)
    for key, view in zip(keys, homes):
        if view is None and key != free_key:
            comm.drop_resident(key)
    return comm.resident(free_key, dtype, shape)


def leave_homes(proc) -> None:
    """At close(): copy the master's shared variables out of their homes, so that the
    homes' shared memory goes with the fork and the variables keep their values."""
    comm = proc.comm
    if not comm.supports_resident:
        return
    ranges = comm.resident_ranges()
    for var in proc.shareds.values():
        value = var.container.storage[0]
        if isinstance(value, np.ndarray) and value.nbytes and overlaps(value, ranges):
            var.set_value(np.array(value, copy=True), borrow=True)


def resident(proc, sids, vars_) -> list:
    """These processes's values of ``vars_``, moved into shared memory the communicator
    can read (and all_reduce write) in place; copied only when an update or
    set_value has replaced a value since the last collective."""
    values = [v.get_value(borrow=True) for v in vars_]
    comm = proc.comm
    if not comm.supports_resident:
        return values
    for sid, a in zip(sids, values):
        if comm.existing(f"sv{sid}", a.dtype, a.shape) is not a:
            break
    else:
        return values  # the usual case in a loop: every value is still its first home
    out = []
    for sid, var, value in zip(sids, vars_, values):
        # what every other variable holds now, those of this collective too (a call that
        # swapped two of them left each holding the other's home; moved ones hold their new)
        view = _home(proc, sid, value.dtype, value.shape, lambda sid=sid: _memory_in_use(proc, exclude={sid}),
                     current=value)
        if view is not value:
            np.copyto(view, value)
            var.set_value(view, borrow=True)
        out.append(view)
    return out


def is_first_home(proc, sid, value) -> bool:
    """Whether ``value`` is variable ``sid``'s first home (the communicator's resident
    array keeps one reference to it)."""
    return proc.comm.existing(f"sv{sid}", getattr(value, "dtype", None), getattr(value, "shape", None)) is value


def spare_home(proc, sid, not_this) -> np.ndarray:
    """An array of ``not_this``'s dtype and shape for variable ``sid`` to take next:
    one of its homes that neither ``not_this`` (its value now) nor any other
    shared variable uses, or new memory; plain memory where the communicator
    keeps no resident arrays. For a kept plan that writes its result out of
    place (:class:`~synkhronos.collectives.base.CommPlan`), then swaps it in."""
    dtype, shape = not_this.dtype, not_this.shape
    if not proc.comm.supports_resident:
        return np.empty(shape, dtype)
    return _home(proc, sid, dtype, shape,
                 lambda: _memory_in_use(proc, exclude={sid}) + ([byte_bounds(not_this)] if not_this.nbytes else []))


def receive_into(proc, sid, var, src) -> np.ndarray:
    """Copy ``src`` into this process's shared-memory home for ``var`` and make it the
    value (memory allocated once, not at every broadcast)."""
    current = var.get_value(borrow=True)
    # the value's own dtype object is the variable's: no dtype to build from its name in a loop
    same_dtype = getattr(current, "dtype", None) is src.dtype or np.dtype(src.dtype) == np.dtype(var.type.dtype)
    if not proc.comm.supports_resident or not same_dtype:
        assign(var, np.array(src, copy=True))
        return var.get_value(borrow=True)
    # _home returns the value itself at once while it is its first home (the usual case in a loop)
    view = _home(proc, sid, src.dtype, src.shape, lambda: _memory_in_use(proc, exclude={sid}), current=current)
    np.copyto(view, src)
    if view is not current:
        var.set_value(view, borrow=True)
    return view


def _memory_in_use(proc, exclude) -> list:
    """Byte ranges of the current values of every other shared variable of this process."""
    ranges = []
    for sid, var in proc.shareds.items():
        if sid in exclude:
            continue
        value = var.container.storage[0]  # the storage itself, never a copy
        if isinstance(value, np.ndarray) and value.nbytes:
            ranges.append(byte_bounds(value))
    return ranges
