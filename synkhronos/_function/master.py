"""The master's half of a call: :class:`Function`, what synk.function returns."""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from typing import TYPE_CHECKING, cast

import numpy as np
from pytensor.scalar import upcast

from .. import _state as state
from .._batching import batch_length, check_batch, split, sub_batch
from .._procs.shmem import oversized
from .._protocol import across_nodes as nodes
from .._protocol.control import Command
from .._protocol.distribute import distribute
from .._protocol.session import note_updates
from ..data import Data
from .._protocol.scratch import fit_scratch
from ..data import check_alive as check_data_alive
from ..data import data as make_data
from ..data import label as data_label
from ..data import ref as data_ref
from ..errors import SynkError, short_repr, user_stacklevel
from .reduce import KeptReduction, combine_inline, finish_among_nodes
from .spec import CallSpec, FunctionSpec, LocalFunction
from .worker import Lane, Share, execute_call, plain_input, share_of

if TYPE_CHECKING:
    from .._kept.records import Table
    from .._protocol.session import Session

__all__ = ["Function"]


class Function:
    """A PyTensor function run data-parallel by every process of the fork.

    Build it with :func:`synkhronos.function`.

    Attributes:
        name: the function's name (for messages).
        output_modes: the reduce op of each output.
        update_modes: the op accumulating each update over ``num_slices``.
    """

    def __init__(self, spec: FunctionSpec, local: LocalFunction):
        self._spec = spec
        self._local = local
        self._scratch: dict = {}
        self._owner: Session | None = None  # the fork it was built for
        self._cast_warned: set = set()  # (input position, dtype) of synk.data cast already
        self._spilled: set = set()  # output subsets whose outputs were too big to ride inline
        self._planned: Table | None = None  # planned calls: _plan_key -> _Plan (the fork's kept.calls_of(fid), once built)
        self._input_names = [getattr(v, "name", None) for v in spec.inputs]
        # per input: (dtype, ndim, plain), plain when PyTensor checks its type by
        # dtype and ndim alone: an ndarray that already has both needs no
        # conversion (the common case, made fast)
        # per input: dtype, ndim, and its static shape (None for an input without one)
        self._types = [(np.dtype(v.type.dtype), v.type.ndim, None if plain_input(v) else tuple(v.type.shape))
                       for v in spec.inputs]

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def output_modes(self) -> list:
        """The reduce op of each output, as given (a ``c_`` prefix, which forces
        the CPU path on a GPU device, is kept)."""
        return list(self._spec.output_modes)

    @property
    def update_modes(self) -> list:
        return list(self._spec.update_ops)

    @property
    def inputs(self) -> list:
        return list(self._spec.inputs)

    def __repr__(self) -> str:
        return f"<synk.Function {self.name!r}: {len(self._spec.inputs)} inputs, {len(self._spec.outputs)} outputs>"

    # -- plain PyTensor ----------------------------------------------------

    def as_pytensor(self, *args, **kwargs):
        """Run the plain PyTensor function in the master only, on all of the inputs.

        Updates apply to the master's shared variables. Returns what
        PyTensor returns for the function's outputs.
        """
        values = self._bind(args, kwargs)
        values = [v.data if isinstance(v, Data) else v for v in values]
        out = self._local.compiled()(*values)
        return self._shape_result(out)

    as_theano = as_pytensor

    def as_op(self, given=None, grads=None):
        """This function as a PyTensor Op, for any PyTensor graph (PyMC, scipy.optimize, ...).

        Each evaluation of the Op is one distributed call of this function.

        Args:
            given: ``{input: value}`` for the inputs that keep one value (an
                input named by its variable, name or position). A numpy value of
                a scattered input is copied into a :func:`synkhronos.data` once;
                a synk.data passes as it is (it must have the input's dtype).
            grads: ``{value output: [gradient output, ...]}``: for a scalar
                output reduced with ``"sum"`` or ``"avg"``, the outputs that hold
                its gradient with respect to each free input (``None`` for an
                input it does not depend on). The Op's gradient then comes from
                the same call as its value.

        Returns:
            A :class:`synkhronos.graph_op.SynkOp`: its inputs are the inputs not
            in ``given``, in order; its outputs all the function's outputs.

        Raises:
            TypeError, ValueError, IndexError: a bad input, value or gradient
                declaration, named in the message.
        """
        from .._integrations.graph_op import build_op, position

        spec = self._spec
        if given is not None and not isinstance(given, dict):
            raise TypeError(f"given must be a dict {{input: value}}, got {given!r}")
        fixed = {}
        for key, value in (given or {}).items():
            i = position(key, spec.inputs, "input", self.name)
            if i in fixed:
                raise ValueError(f"input {spec.inputs[i].name or i!r} of function {self.name!r} given twice")
            if isinstance(value, Data) and value.dtype != np.dtype(spec.inputs[i].type.dtype):
                raise TypeError(f"given: synk.data {data_label(value)} has dtype {value.dtype}; input "
                                f"{spec.inputs[i].name or i!r} expects {spec.inputs[i].type.dtype}")
            value = self._check_value(i, value)
            if not spec.bcast[i] and not isinstance(value, Data):  # rows in shared memory once
                value = make_data(value, var=spec.inputs[i], name=spec.inputs[i].name)
            fixed[i] = value
        return build_op(self, spec.inputs, spec.outputs, spec.bcast, fixed, grads)

    # -- inputs ------------------------------------------------------------

    def build_inputs(self, *args, force_cast=False, oversize=1.0, minibatch=False, **kwargs):
        """Copy input values into new :class:`synkhronos.Data` objects, one per input.

        Passing these to the function later sends no input data at call time.

        Args:
            *args: one value per input, in order, as for a call.
            force_cast: passed to :func:`synkhronos.data`.
            oversize: passed to :func:`synkhronos.data`.
            minibatch: passed to :func:`synkhronos.data`: one flag for every
                input, or a list with one flag per input.
            **kwargs: input values by input name.

        Returns:
            A list of Data (a single Data for a one-input function).

        Raises:
            TypeError: missing, extra or unknown inputs; a value
                :func:`synkhronos.data` refuses.
            ValueError: a ``minibatch`` list of the wrong length.
        """
        n = len(self._spec.inputs)
        if not kwargs and len(args) != n:
            raise TypeError(f"function {self.name!r} takes {n} inputs, build_inputs got {len(args)}")
        values = self._bind(args, kwargs)
        flags = list(minibatch) if isinstance(minibatch, (list, tuple)) else [minibatch] * n
        if len(flags) != n:
            raise ValueError(f"minibatch has {len(flags)} entries for the {n} inputs of function "
                             f"{self.name!r}")
        out = []
        for var, value, flag in zip(self._spec.inputs, values, flags):
            out.append(make_data(value, var=var, force_cast=force_cast, oversize=oversize,
                                 minibatch=flag, name=var.name))
        return out[0] if len(out) == 1 else out

    def _bind(self, args, kwargs):
        inputs = self._spec.inputs
        if len(args) > len(inputs):
            raise TypeError(f"function {self.name!r} takes {len(inputs)} inputs, got {len(args)} "
                            "positional arguments")
        values = list(args) + [_MISSING] * (len(inputs) - len(args))
        for key, value in kwargs.items():
            try:
                i = self._input_names.index(key)
            except ValueError:
                raise TypeError(f"function {self.name!r} has no input named {key!r}; its inputs are "
                                f"{self._input_names}") from None
            if values[i] is not _MISSING:
                raise TypeError(f"input {key!r} of function {self.name!r} given twice")
            values[i] = value
        missing = [self._input_names[i] or f"#{i}" for i, v in enumerate(values) if v is _MISSING]
        if missing:
            raise TypeError(f"function {self.name!r} is missing inputs {missing}")
        return values

    def _check_value(self, i, value):
        dtype, ndim, static = self._types[i]
        if static is None and type(value) is np.ndarray and value.dtype == dtype and value.ndim == ndim:
            return value
        var = self._spec.inputs[i]
        label = f"input {var.name or i!r} of function {self.name!r}"
        # wrong ndim or dtype is a TypeError, as in PyTensor's own functions
        if isinstance(value, Data):
            check_data_alive(value)
            if value.ndim != var.type.ndim:
                raise TypeError(f"{label} expects ndim={var.type.ndim}, got synk.data with ndim={value.ndim}")
            if value.dtype != np.dtype(var.type.dtype):
                return self._cast_data(i, value, np.dtype(var.type.dtype), label)
            return value
        arr = np.asarray(value) if not isinstance(value, np.ndarray) else value
        if arr.dtype.kind in "OUSV":  # objects, strings, raw bytes
            raise TypeError(f"{label} expects a numeric array of dtype {var.type.dtype}, got an array of "
                            f"dtype {arr.dtype}: {short_repr(value)}")
        if arr.ndim != var.type.ndim:
            raise TypeError(f"{label} expects ndim={var.type.ndim}, got ndim={arr.ndim} (shape {arr.shape})")
        try:
            return var.type.filter(value, strict=False,
                                   allow_downcast=self._spec.kwargs.get("allow_input_downcast"))
        except TypeError as err:
            raise TypeError(f"{label}: {err}") from None

    def _cast_data(self, i, value: Data, want: np.dtype, label: str) -> Data:
        """A synk.data of another dtype, cast where PyTensor would cast a numpy array of
        its dtype: one copy per call, into shared memory, and a warning the first time."""
        downcast = self._spec.kwargs.get("allow_input_downcast")
        if not (downcast or upcast(want.name, value.dtype.name) == want.name):
            raise TypeError(f"{label} expects dtype {want}, got synk.data {data_label(value)} of dtype "
                            f"{value.dtype}, which would lose precision: create it with "
                            f"synk.data(value, dtype={want.name!r}) (or var=the input), or pass "
                            "allow_input_downcast=True to synk.function")
        if (i, value.dtype) not in self._cast_warned:
            self._cast_warned.add((i, value.dtype))
            warnings.warn(f"{label} expects dtype {want}, got synk.data {data_label(value)} of dtype "
                          f"{value.dtype}: every call casts a copy of it ({value.size * want.itemsize} "
                          f"bytes now) into shared memory; create it with synk.data(value, "
                          f"dtype={want.name!r}) to pass it without a copy",
                          stacklevel=user_stacklevel())
        d = self._scratch_data(("cast", i), want, value.shape)
        d.minibatch = value.minibatch
        if value.size:
            np.copyto(d.data, value.data, casting="unsafe")
        return d

    def _scratch_data(self, key, dtype, shape):
        return fit_scratch(self._scratch, key, dtype, shape, f"{self.name}:{key}")

    # -- the call ----------------------------------------------------------

    @state.serialized
    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1,
                 device_outputs=False, **kwargs):
        """Run data-parallel: scatter inputs, compute everywhere, reduce outputs.

        Args:
            *args: one value per input (numpy arrays, array-likes or
                synk.data), in order. Dtypes follow PyTensor's rule: a value
                whose dtype casts to the input's without loss is cast (also a
                synk.data, copied into shared memory on every call, with a
                warning the first time: make it with the input's dtype to
                avoid the copy); any other is a TypeError.
            **kwargs: input values by input name.
            output_subset: indices of the outputs to compute and return (a
                list of ints).
            batch: rows of the scattered inputs to use: an int (the first
                rows), a slice, or a list/array of indices.
            batch_s: rows of the sliceable shared variables: a slice or an
                index list used by every process, or a list of those with one
                entry per process (rank order).
            num_slices: each process accumulates over this many slices of its
                rows (saves memory); updates accumulate with their op.
            device_outputs: on a GPU device, return the outputs as JAX arrays
                on the master's GPU instead of numpy arrays (for chaining GPU
                work). On a CPU device outputs are numpy arrays either way.

        Returns:
            The reduced outputs: a list for a list of outputs (or with
            ``output_subset``), one array for a single output.

        Raises:
            TypeError: an input of the wrong ndim or dtype (as in PyTensor),
                or a bad keyword value, named in the message.
            ValueError, IndexError: bad inputs or rows, named in the message.
            WorkerError or the worker's own exception type: a process failed.
                Every process whose own share ran without error has applied its
                updates; one whose share raised has applied none (a note on the
                exception names the ranks of each). Across nodes the same holds
                in every process of every node.
        """
        # inside an XLA callback the share runs a copy compiled without JAX, which no plan keeps
        plannable = _plannable(kwargs, output_subset, batch, batch_s, num_slices, device_outputs) \
            and not state.in_xla_callback()
        s = state.current()
        # across nodes: a call that fails here before its step reached the others still takes it
        before = None if s is None or s is not self._owner else nodes.steps_begun(s.proc)
        try:
            if plannable and self._planned and self._owner is s:
                plan = self._planned.get(self._plan_key(args))
                if plan is not None:
                    return self._call_planned(plan, args, device_outputs)
            return self._call(args, kwargs, output_subset, batch, batch_s, num_slices, device_outputs, plannable)
        except Exception as err:
            if before is not None and s is not None and os.getpid() == s.pid:  # (never in a child the user forked)
                nodes.failed_step(s, before, f"call {self.name}", err)
            raise

    def _call(self, args, kwargs, output_subset, batch, batch_s, num_slices, device_outputs, plannable):
        """A call, checked and prepared from scratch (and planned for the next
        calls of the same kind when it can be)."""
        s = state.running_session()
        if self._owner is not s:
            raise SynkError(
                f"function {self.name!r} was built for a fork that was closed (synk.close()); "
                "build it again with synk.function() after this synk.fork()")
        s.usable()
        # this call may move scratch memory that a plan writes into (synk.function set _planned with _owner)
        cast("Table", self._planned).clear()
        spec = self._spec
        batch_s = self._check_batch_s(batch_s, s.n_parallel)
        if isinstance(num_slices, bool) or not isinstance(num_slices, (int, np.integer)) or num_slices < 1:
            raise ValueError(f"num_slices must be a positive int, got {num_slices!r}")
        if not isinstance(device_outputs, bool):
            raise TypeError(f"device_outputs must be True or False, got {device_outputs!r}")
        subset = self._check_subset(output_subset)
        if num_slices > 1:
            self._check_sliceable_outputs(subset)
        values = [self._check_value(i, v) for i, v in enumerate(self._bind(args, kwargs))]
        n_rows, norm_batch = self._rows(values, batch)
        if self._spec.fid not in s.distributed:
            distribute()
        own: dict = {}
        refs = []
        me = s.proc.rank
        for i, value in enumerate(values):
            if spec.bcast[i]:
                if isinstance(value, Data):
                    refs.append(("b", data_ref(value)))
                else:
                    own[i] = value
                    refs.append(("b", self._scratch_fill_whole(i, value)))
            elif isinstance(value, Data):
                refs.append(("m" if value.minibatch else "s", data_ref(value)))
            else:
                own[i], ref = self._scatter_numpy(i, value, norm_batch, n_rows, me, s.n_parallel)
                refs.append(("m", ref))
        batch_ref = norm_batch
        if isinstance(norm_batch, np.ndarray):
            d = self._scratch_data("batch", np.int64, norm_batch.shape)
            d.data[...] = norm_batch
            batch_ref = data_ref(d)
        inline = self._inline(s.proc, subset)
        call = CallSpec(spec.fid, refs, batch_ref, n_rows, int(num_slices), subset, batch_s, inline)
        wire = call.to_wire()
        if plannable:
            self._plan(args, values, call, wire, own)
        results = s.run(Command.CALL, wire, local=lambda proc, _: execute_call(proc, call, own))
        return self._finish(s, call, results, device_outputs)

    def _finish(self, s, call, results, device_outputs):
        """The call's results as the user gets them, from what the master's share returned."""
        if call.inline:
            results, spilled, weight = combine_inline(s.proc, results, self._local.plan(s.proc, call.subset)[0])
            if spilled:  # outputs this big reduce faster through the communicator
                self._spilled.add(call.subset)
                cast("Table", self._planned).clear()  # (synk.function set it with _owner)
            if s.proc.comm.among_nodes() is not None:
                results = self._among_nodes(s, call, results, weight)
        results = s.proc.device.to_user(results, device_outputs)
        if call.subset is not None:
            return results
        return self._shape_result(results)

    # -- planned calls -----------------------------------------------------
    #
    # A training or evaluation loop calls a function again and again with
    # inputs of the same shapes. The first such call is checked and prepared
    # in full; what it sends is kept (the message, pickled; where each numpy
    # input's rows go), and the next calls with inputs of the same kinds and
    # shapes only copy the rows and send the same bytes, which the workers do
    # not even unpickle again.

    def _plan_key(self, args):
        """What a planned call must match: per input its shape (a numpy array of
        the input's dtype and ndim, and of its static shape where it has one) or
        its synk.data ref; None when a value needs the full checks."""
        if len(args) != len(self._types):
            return None
        key = []
        for value, (dtype, ndim, static) in zip(args, self._types):
            if type(value) is np.ndarray:
                # (a planned input skips PyTensor's filter: it must be what the filter passes as
                # it is, so also of the dtype's own type number: np.longlong is "== int64" but
                # number 9, not 7, which the filter converts and C code refuses)
                vdtype = value.dtype
                if (vdtype is not dtype and (vdtype != dtype or vdtype.num != dtype.num)) \
                        or value.ndim != ndim or not value.flags.aligned:
                    return None
                if static is not None and any(s is not None and s != d for s, d in zip(static, value.shape)):
                    return None
                key.append(value.shape)
            elif isinstance(value, Data):
                if value.dtype != dtype or value.ndim != ndim:
                    return None
                key.append((data_ref(value), value.minibatch))
            else:
                return None
        return tuple(key)

    def _plan(self, args, values, call, wire, own) -> None:
        """Keep what this call sends, for the next calls with inputs like ``args``."""
        key = self._plan_key(args)
        if key is None or any(v is not a for v, a in zip(values, args)):
            return  # a value was converted: the checks must run every time
        # (_call checked that this fork built it: synk.function set both)
        owner, planned = cast("Session", self._owner), cast("Table", self._planned)
        copies, mine = [], []
        for i in range(len(args)):
            if not isinstance(args[i], np.ndarray):
                continue
            kind, ref = call.inputs[i]
            rows = None if kind == "b" else split(call.n_rows, owner.n_parallel, owner.proc.rank)
            mine.append((i, None if rows is None else slice(*rows)))
            if ref is not None:
                d = self._scratch[i]
                if oversized(d.alloc_size * d.dtype.itemsize, d.size * d.dtype.itemsize):
                    return  # left by a larger call: the full path counts the uses that shrink it
                dst = d.data
                # a broadcast input is copied whole (``...``: also a 0-d one), a scattered one
                # without the master's own rows
                pieces = [...] if rows is None else [slice(lo, hi) for lo, hi in ((0, rows[0]), (rows[1], call.n_rows))
                                                     if hi > lo]
                copies.append((i, dst, pieces))
        proc = owner.proc
        share = share_of(proc, call, keep=True, own_keys=own.keys())
        planned.keep(key, _Plan(call, wire, pickle.dumps(([], wire), protocol=pickle.HIGHEST_PROTOCOL),
                                copies, mine, share if share.fn is not None else None,
                                Lane.of(proc, call, share), KeptReduction() if proc.size == 1 else None,
                                call.inline and proc.comm.among_nodes() is not None))

    def _call_planned(self, plan, args, device_outputs: bool):
        s = state.running_session()
        for i, dst, pieces in plan.copies:
            value = args[i]
            for rows in pieces:
                dst[rows] = value[rows]
        call, lane = plan.call, plan.lane
        if lane is not None:
            own_pairs = [(i, args[i] if rows is None else args[i][rows]) for i, rows in plan.mine]
            outs, mine = s.run(Command.CALL, plan.wire, body=plan.body, local=lambda proc, _: lane.run(proc, own_pairs))
            results = lane.combine(outs, mine)
            if results is None:  # out of the ordinary: the general path sorts it out
                return self._finish(s, call, (outs, mine, lane.weight), device_outputs)
            if plan.among_nodes:
                results = self._among_nodes(s, call, results, lane.total)
            return self._shape_result(s.proc.device.to_user(results, device_outputs))
        own = {i: args[i] if rows is None else args[i][rows] for i, rows in plan.mine}
        results = s.run(Command.CALL, plan.wire, body=plan.body,
                        local=lambda proc, _: execute_call(proc, call, own, plan.share, plan.reduction))
        return self._finish(s, call, results, device_outputs)

    def _among_nodes(self, s, call, results, weight):
        """Across nodes, in the master of a node of several processes: an inline call's
        results of this node reduced among the nodes (:func:`.reduce.finish_among_nodes`),
        a step of this node master's own once its workers answered. Its failure is raised
        with the note of a failed call: every process of this node applied the updates."""
        try:
            return s.step_alone(f"call {self.name}", finish_among_nodes, s.proc, results, weight,
                                self._local.plan(s.proc, call.subset)[1], call.n_rows)
        except Exception as err:
            note_updates(err, s.proc, {})
            raise

    def _inline(self, proc, subset) -> bool:
        """Whether this call's outputs ride back with the workers' answers
        (small, host arrays, one node's processes: see ``Communicator.inline_outputs``)
        instead of going through a collective. Across nodes the node master then makes
        the exchanges among the nodes (:func:`.reduce.finish_among_nodes`)."""
        if subset in self._spilled:
            return False
        return all(comm.inline_outputs for _, comm, _ in self._local.plan(proc, subset)[1])

    def _rows(self, values, batch) -> tuple:
        """``(n_rows, norm_batch)`` of a call: the rows the scattered inputs give
        (None without scattered inputs) and ``batch`` normalised."""
        scattered = [i for i, b in enumerate(self._spec.bcast) if not b]
        n_rows, norm_batch = None, None
        if scattered:
            full = [len(values[i]) if not _is_minibatch(values[i]) else None for i in scattered]
            lengths = [n for n in full if n is not None]
            if batch is None and len(set(lengths)) > 1:
                names = [self._input_names[i] for i in scattered]
                raise ValueError(f"scattered inputs of function {self.name!r} differ in length: "
                                 f"{dict(zip(names, full))}")
            ref_len = min(lengths) if lengths else min(len(values[i]) for i in scattered)
            norm_batch = check_batch(batch, ref_len)
            n_rows = batch_length(norm_batch, ref_len)
            short = [self._input_names[i] for i in scattered
                     if _is_minibatch(values[i]) and len(values[i]) < n_rows]
            if short:
                raise ValueError(f"minibatch inputs {short} hold fewer rows than the {n_rows} asked for")
        elif batch is not None:
            raise ValueError(f"batch={batch!r} given, but function {self.name!r} has no scattered inputs")
        return n_rows, norm_batch

    def _scratch_fill_whole(self, i, value):
        if state.running_session().n_parallel == 1:
            return None  # nobody else reads it
        d = self._scratch_data(i, value.dtype, value.shape)
        if value.size:
            np.copyto(d.data, value)
        return data_ref(d)

    def _scatter_numpy(self, i, value, batch, n_rows, me, n):
        """Copy the other processes' rows of a numpy input to shared memory; keep ours."""
        if n == 1:
            return value if batch is None else value[sub_batch(batch, 0, n_rows)], None
        d = self._scratch_data(i, value.dtype, (n_rows,) + value.shape[1:])
        dst = d.data
        my_lo, my_hi = split(n_rows, n, me)
        for lo, hi in ((0, my_lo), (my_hi, n_rows)):
            if hi > lo:
                sel = sub_batch(batch, lo, hi)
                if isinstance(sel, slice):
                    dst[lo:hi] = value[sel]
                else:
                    np.take(value, sel, axis=0, out=dst[lo:hi])
        return value[sub_batch(batch, my_lo, my_hi)], data_ref(d)

    def _check_batch_s(self, batch_s, n):
        """None, or one selection per rank (each None, a slice or an int64 array)."""
        if batch_s is None:
            return None
        if not self._spec.sliceable:
            raise TypeError(f"function {self.name!r} has no sliceable shared variables; "
                            f"batch_s must be None, got {batch_s!r}")
        per_rank = isinstance(batch_s, (list, tuple)) and len(batch_s) > 0 and all(
            b is None or isinstance(b, (slice, list, tuple, np.ndarray)) for b in batch_s)
        items = list(batch_s) if per_rank else [batch_s] * n
        if per_rank and len(items) != n:
            raise ValueError(f"batch_s has {len(items)} entries, one per process expected ({n})")
        out: list[slice | np.ndarray | None] = []
        for item in items:
            if item is None or isinstance(item, slice):
                check_batch(item, 1 << 62)
                out.append(item)
            elif isinstance(item, (list, tuple, np.ndarray)):
                arr = np.asarray(item)
                if arr.size == 0:
                    arr = arr.astype(np.int64)
                if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                    raise TypeError(f"batch_s entries must be slices or 1-d integer index lists, got {item!r}")
                out.append(arr.astype(np.int64))
            else:
                raise TypeError(f"batch_s must be a slice, an index list, or a list of those "
                                f"(one per process), got {item!r}")
        return out

    def _check_sliceable_outputs(self, subset) -> None:
        """With ``num_slices`` > 1, refuse 0-d outputs that keep every process's value
        (``gather``, ``None``): a process would have one value per slice instead of one."""
        spec = self._spec
        if all(spec.bcast) and not spec.sliceable:
            return  # nothing is split into slices
        chosen = range(len(spec.outputs)) if subset is None else subset
        flat = [spec.outputs[k].name or f"#{k}" for k in chosen
                if spec.output_ops[k] in (None, "gather") and spec.outputs[k].type.ndim == 0]
        if flat:
            raise ValueError(f"outputs {flat} of function {self.name!r} are 0-d with op 'gather' or None: "
                             "with num_slices > 1 each process would have one value per slice instead "
                             "of one value; use num_slices=1 or a reducing op for them")

    def _check_subset(self, output_subset):
        if output_subset is None:
            return None
        n = len(self._spec.outputs)
        if not isinstance(output_subset, (list, tuple, range, np.ndarray)):
            raise TypeError(f"output_subset must be a list of output indices, got {output_subset!r}")
        wrong = [k for k in output_subset if isinstance(k, (bool, np.bool_))
                 or not isinstance(k, (int, np.integer))]
        if wrong:
            raise TypeError(f"output_subset must hold int output indices, got {wrong[0]!r} "
                            f"in {output_subset!r}")
        subset = tuple(int(k) for k in output_subset)
        bad = [k for k in subset if not 0 <= k < n]
        if bad:
            raise IndexError(f"output_subset {list(output_subset)} names outputs {bad}; "
                             f"function {self.name!r} has {n} outputs")
        return subset

    def _shape_result(self, results):
        if self._spec.returns_list:
            return list(results)
        return results[0]


_MISSING = object()


def _plannable(kwargs, output_subset, batch, batch_s, num_slices, device_outputs) -> bool:
    """Whether a call's keywords let it be planned (inputs in order, all of them, whole;
    ``device_outputs`` only changes what the outputs are handed back as)."""
    return (not kwargs and output_subset is None and batch is None and batch_s is None
            and type(num_slices) is int and num_slices == 1 and type(device_outputs) is bool)


@dataclasses.dataclass
class _Plan:
    """What a call sends, kept for the next calls with inputs of the same kinds and shapes."""

    call: CallSpec
    wire: tuple
    body: bytes      # ([], wire) pickled
    copies: list     # (input, scratch array, [(lo, hi) rows to copy]) per numpy input others read
    mine: list       # (input, slice of the master's rows or None for all) per numpy input
    share: Share | None  # the master's share, kept
    lane: Lane | None    # the master's share as a lane, where it can run as one
    reduction: KeptReduction | None  # alone in the fork: its output reduction, kept (see there)
    among_nodes: bool  # the lane's results of this node are then reduced among the nodes


def _is_minibatch(value) -> bool:
    return isinstance(value, Data) and value.minibatch
