"""Reduction operators shared by every communicator backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .._kept.records import Table

__all__ = ["REDUCE_OPS", "REDUCE_OP_NAMES", "OUTPUT_OPS", "check_op", "parse_op", "result_dtype", "cast_to", "reducer_of",
           "agreed_layout", "identity", "Reducer", "kept_reducer", "fold_ufunc", "avg_work_dtype"]

#: name -> numpy ufunc that combines two contributions; "avg" is a weighted sum.
REDUCE_OPS = {
    "sum": np.add,
    "avg": np.add,
    "prod": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def _complex_product(a, b, out=None):
    """``np.multiply`` of complex arrays into new memory, copied into ``out`` if given.

    numpy multiplies one complex element by another loop (other last bits: an FMA)
    when the output is one of the operands than when it is other memory, so a fold
    that wrote over its accumulator, or over the first part in place, gave other
    bits than one into new memory: the same all_reduce differed by path (a kept
    direct run against a command's). Every fold of a complex ``prod`` goes through
    here, so every path gives the bits of ``functools.reduce(np.multiply, parts)``."""
    got = np.multiply(a, b)
    if out is None:
        return got
    np.copyto(out, got)
    return out


def fold_ufunc(op: str, dtype):
    """The function every reduction folds two ``dtype`` contributions with for ``op``:
    :data:`REDUCE_OPS`'s ufunc, except a complex ``prod``'s (:func:`_complex_product`)."""
    if op == "prod" and np.dtype(dtype).kind == "c":
        return _complex_product
    return REDUCE_OPS[op]


#: The reduce ops a user may name (each also with a ``c_`` prefix).
REDUCE_OP_NAMES = ("avg", "sum", "prod", "max", "min")
#: What a function output may name: a reduce op, or gather.
OUTPUT_OPS = REDUCE_OP_NAMES + ("gather",)


def check_op(op, allowed=REDUCE_OP_NAMES, what="op") -> str:
    """Validate a reduce-op name; return it without any ``c_`` prefix."""
    if not isinstance(op, str):
        raise TypeError(f"{what} must be one of {sorted(allowed)}, got {op!r}")
    name = op[2:] if op.startswith("c_") else op
    if name not in allowed:
        raise ValueError(f"unknown {what} {op!r}; expected one of {sorted(allowed)} "
                         "(optionally with a 'c_' prefix)")
    return name


def parse_op(op, allowed=REDUCE_OP_NAMES, what="op") -> tuple:
    """Validate a reduce-op name; return ``(name, cpu)``: the name without its
    ``c_`` prefix, and whether the prefix asks for the CPU path."""
    return check_op(op, allowed, what), isinstance(op, str) and op.startswith("c_")


_FLOAT64 = np.dtype(np.float64)


def result_dtype(dtype, op) -> np.dtype:
    """The dtype of ``op`` over arrays of ``dtype``, the same on every path.

    ``avg`` of integers or booleans is float64, as PyTensor's own ``mean`` of
    them is; every other op keeps the dtype.
    """
    dtype = np.dtype(dtype)
    if op == "avg" and dtype.kind in "biu":
        return _FLOAT64
    return dtype


def avg_work_dtype(dtype) -> np.dtype:
    """The dtype an ``avg`` over arrays of ``dtype`` is computed in, on every path:
    float64 for integers and booleans (its result, as PyTensor's ``mean`` of them),
    float32 for float16 (rounded back to float16 at the end, as PyTensor's ``mean``
    of float16 accumulates in float32: a sum of float16 overflowed to inf where the
    mean, 40000, fits), else ``dtype`` itself."""
    dtype = np.dtype(dtype)
    if dtype == _FLOAT16:
        return _FLOAT32
    return result_dtype(dtype, "avg")


_FLOAT16, _FLOAT32 = np.dtype(np.float16), np.dtype(np.float32)


def cast_to(value, dtype):
    """``value`` as ``dtype``; floats going into integers or booleans are rounded
    to the nearest value (ties to even), never truncated.

    This is how a reduction lands in a variable of its own dtype: the ``avg``
    of int64 ``[7, 7, 8]`` stored in an int64 variable is 7, and that of
    ``[6, 7, 7, 7]`` is 7 (6.75 rounds up). Works on numpy and CuPy arrays.

    The nearest value of a 64-bit integer dtype to a float at or past 2**63
    (2**64 unsigned) is its largest: float64 has no value between that and
    the largest int64 (uint64), so the ``avg`` of int64 values near the top
    rounds there, and a plain cast wrapped it to the smallest (the ``avg`` of
    ``[2**63 - 1] * 2`` came back ``-2**63``; of uint64 ``2**64 - 1``, 0).
    """
    dtype = np.dtype(dtype)
    if value.dtype == dtype:
        return value
    if dtype.kind in "biu" and value.dtype.kind in "fc":
        value = value.real.round() if value.dtype.kind == "c" else value.round()
        if dtype.kind in "iu" and dtype.itemsize == 8:
            return _saturated(value, dtype)
    return value.astype(dtype)


def _saturated(value, dtype):
    """Rounded floats ``value`` (a new array, numpy or CuPy) as 64-bit integers
    ``dtype``, those at or past the top (``float(max)``, 2**63 or 2**64) as its
    largest value. (A float64 average of such integers is never below the smallest.)"""
    top = np.iinfo(dtype).max
    over = value >= float(top)
    if not over.any():
        return value.astype(dtype)
    if isinstance(value, np.generic):  # (a 0-d array's round() is a numpy scalar)
        return np.asarray(top, dtype=dtype)
    value[over] = 0  # (its own array: round() made it)
    out = value.astype(dtype)
    out[over] = top
    return out


def _fold(ufunc, parts, out=None):
    """``ufunc`` over all of ``parts`` in one pass per extra part (no copy of the first)."""
    if len(parts) == 1:
        if out is None:
            return np.array(parts[0], copy=True)
        np.copyto(out, parts[0])
        return out
    acc = ufunc(parts[0], parts[1], out=out)
    if type(acc) is not np.ndarray:  # 0-d parts give a numpy scalar
        acc = np.asarray(acc)
    for x in parts[2:]:
        ufunc(acc, x, out=acc)
    return acc


def combine(parts, op: str, weights=None, out=None):
    """Reduce equal-shaped arrays ``parts`` with ``op``.

    ``avg`` is ``sum(w_r * x_r) / sum(w_r)``: equal weights give the sum times
    the reciprocal of the count, row counts give the mean over all rows when
    parts split unevenly, computed in :func:`avg_work_dtype` (float32 for float16
    parts, rounded back). The result has :func:`result_dtype` (float64 for the
    ``avg`` of integers); an ``out`` of another dtype receives it through
    :func:`cast_to` (rounded, never truncated). A caller that reduces parts
    of the same kind again and again keeps a :class:`Reducer` instead.
    """
    first = parts[0]
    if out is not None and out.dtype != result_dtype(first.dtype, op):
        out[...] = cast_to(np.asarray(combine(parts, op, weights)), out.dtype)
        return out
    return Reducer(op, first.dtype, first.shape, weights, len(parts))(parts, out)


def _normalized(weights, n: int) -> list:
    """``avg``'s weights as fractions of their total (equal when they add up to 0)."""
    w = [1.0] * n if weights is None else [float(x) for x in weights]  # lists: tiny, fast
    total = sum(w)
    return [x / total for x in w] if total > 0 else [1.0 / n] * n


#: The dtype kinds whose 0-d parts each op combines as numpy scalars: the
#: float ones (and every kind for avg, whose result is a float).
_SCALAR_KINDS = {"sum": "f", "prod": "f", "avg": "fbiu"}


class Reducer:
    """:func:`combine` of ``n`` parts of one dtype and shape with one set of
    ``weights``, with all that depends on those alone worked out once: the
    path, the result type, the weights as fractions and as scalars. A loop
    of calls reduces outputs of the same kind every time and keeps one.

    0-d parts whose result is a float are combined as numpy scalars: the same
    IEEE operations in the same order as the array loops (numpy's scalar
    arithmetic of a float type is that of its array loops), without a ufunc
    call's overhead (~1 us each); tests check the bytes against the array path.
    """

    __slots__ = ("op", "dtype", "shape", "weights", "n", "scalar_path", "convert", "final", "scales", "equal", "fold",
                 "run")

    def __init__(self, op: str, dtype, shape, weights, n: int):
        self.op, self.dtype, self.shape, self.n = op, np.dtype(dtype), tuple(shape), n
        self.weights = None if weights is None else list(weights)
        self.scalar_path = not self.shape and self.dtype.kind in _SCALAR_KINDS.get(op, "")
        self.convert, self.final, self.equal = None, None, True
        self.fold = fold_ufunc(op, self.dtype)  # (what folds two parts; avg's is np.add)
        self.scales: list = []  # avg: the weights as fractions, scalars of the dtype it works in
        if op == "avg":
            work = avg_work_dtype(self.dtype)
            if self.dtype != work:  # integers and booleans in float64 (PyTensor's mean of ints), float16 in float32
                self.convert = work
            if work != result_dtype(self.dtype, op):  # float16: in float32, then rounded back
                self.final = self.dtype
            w = _normalized(weights, n)
            self.equal = w.count(w[0]) == n
            self.scales = [work.type(x) for x in w]
        #: ``run(parts)``: the reduction into new memory, by the path chosen here
        self.run = self._run_path()

    def _run_path(self):
        if self.scalar_path:
            return self._scalars
        if self.op != "avg":
            ufunc = self.fold
            return lambda parts: _fold(ufunc, parts)
        if self.equal and self.convert is None:
            return self._avg_equal
        return self._general

    def fits(self, first, weights, n: int) -> bool:
        """Whether ``n`` parts like ``first`` with ``weights`` are what this reducer reduces."""
        return (n == self.n and first.shape == self.shape and first.dtype == self.dtype
                and (weights == self.weights if self.op == "avg" else True))

    def __call__(self, parts, out=None) -> np.ndarray:
        """The reduction of ``parts``; into ``out`` (of the result's dtype) if given."""
        if out is None:
            return self.run(parts)
        return self._general(parts, out)

    def _general(self, parts, out=None) -> np.ndarray:
        op = self.op
        if op != "avg":
            return _fold(self.fold, parts, out)
        if self.final is not None:  # (into new memory of the work dtype, then rounded into the result)
            acc = self._weighted([np.asarray(p, dtype=self.convert) for p in parts], None)
            if out is None:
                return acc.astype(self.final)
            np.copyto(out, acc, casting="same_kind")
            return out
        if self.convert is not None:
            parts = [np.asarray(p, dtype=self.convert) for p in parts]
        return self._weighted(parts, out)

    def _weighted(self, parts, out) -> np.ndarray:
        """``avg`` of ``parts`` of the dtype it works in: the sum times the reciprocal
        (equal weights), else each part times its share, summed in order."""
        if self.equal:
            acc = _fold(np.add, parts, out)
            acc *= self.scales[0]
            return acc
        acc = np.asarray(np.multiply(parts[0], self.scales[0], out=out))
        tmp = np.empty_like(acc)
        for x, s in zip(parts[1:], self.scales[1:]):
            np.multiply(x, s, out=tmp)
            acc += tmp
        return acc

    def _avg_equal(self, parts) -> np.ndarray:
        """``avg`` with equal weights of float parts: the sum times the reciprocal."""
        if self.n == 2 and self.shape:  # two arrays (not 0-d, whose sum is a scalar): no fold
            acc = np.add(parts[0], parts[1])
        else:
            acc = _fold(np.add, parts)
        acc *= self.scales[0]
        return acc

    def _scalars(self, parts) -> np.ndarray:
        return np.asarray(self.scalar(parts))

    def scalar(self, parts):
        """The reduction of 0-d ``parts`` (a reducer on the scalar path) as a numpy
        scalar: the same steps as the array loops, in the same order."""
        if self.final is not None:
            return self.final.type(self._scalar_steps(parts))
        return self._scalar_steps(parts)

    def _scalar_steps(self, parts):
        op, convert = self.op, self.convert
        it = iter(parts)
        acc = next(it)[()]
        if convert is not None:
            acc = convert.type(acc)
        if op == "prod":
            for x in it:
                acc = acc * x[()]
            return acc
        if op == "sum" or self.equal:
            if convert is None:
                for x in it:
                    acc = acc + x[()]
            else:
                for x in it:
                    acc = acc + convert.type(x[()])
            return acc if op == "sum" else acc * self.scales[0]
        acc = acc * self.scales[0]
        for x, s in zip(it, self.scales[1:]):
            x = x[()]
            acc = acc + (x if convert is None else convert.type(x)) * s
        return acc


def kept_reducer(cache: Table, op: str, parts) -> Reducer:
    """The :class:`Reducer` of equally weighted ``parts`` (equal dtypes and shapes,
    checked by the caller) with ``op``, kept in ``cache`` (``proc.kept.reducers``, a
    :class:`~synkhronos._kept.records.Table`) from call to call."""
    first = parts[0]
    return reducer_of(cache, op, first.dtype, first.shape, len(parts))


def reducer_of(cache: Table, op: str, dtype, shape, n: int) -> Reducer:
    """The :class:`Reducer` of ``n`` equally weighted parts of ``dtype`` and ``shape``
    with ``op``, kept in ``cache`` (see :func:`kept_reducer`)."""
    key = (op, dtype, shape, n)
    got = cache.get(key)
    if got is None:
        got = cache.keep(key, Reducer(op, dtype, shape, None, n))
    return got


def agreed_layout(metas, op: str, who: str = "rank"):
    """``(present, layout)`` from every process's ``(layout or None, weight)``:
    the processes that contribute and their common layout, or None when none does.

    Raises:
        ValueError: two contributors hold different dtypes or shapes (named).
    """
    present = [r for r, (lay, _) in enumerate(metas) if lay is not None]
    if not present:
        return present, None
    layout = metas[present[0]][0]
    for r in present[1:]:
        if metas[r][0] != layout:
            raise ValueError(f"cannot {op}-reduce: {who} {present[0]} holds "
                             f"{[(str(d), s) for d, s in layout]} but {who} {r} holds "
                             f"{[(str(d), s) for d, s in metas[r][0]]}")
    return present, layout


def identity(op: str, work):
    """The element of ``op`` in dtype ``work``: what a process with nothing to add
    contributes where a backend must send something (NCCL, MPI)."""
    work = np.dtype(work)
    if op in ("sum", "avg"):  # (-0.0: x + -0.0 is x bit for bit, a zero's sign too; x + 0.0 is not for x = -0.0)
        return complex(-0.0, -0.0) if work.kind == "c" else -0.0 if work.kind == "f" else 0
    if op == "prod":
        return 1
    if work.kind == "f":
        return -np.inf if op == "max" else np.inf
    info = np.iinfo(work)
    return info.min if op == "max" else info.max
