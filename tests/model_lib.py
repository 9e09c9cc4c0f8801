"""The model behind tests/test_model.py: a plain numpy copy of every process's
copy of every shared variable, random steps applied to synkhronos and to the
model by the documented meaning of each call, and a minimiser for a failing
sequence of steps.

A step is data: ``Step(kind, seed, gap_ms)``. Everything a step does is drawn
at the time it runs from ``seed`` and the model's state (which variables,
which shapes, which values), so that any subsequence of a run is itself a
valid run: the minimiser deletes steps freely. ``World.apply`` writes, for
every step, the synkhronos calls it made as Python-ish lines (``World.log``);
values are written as ``val(dtype, shape, seed)``, which this module
rebuilds bit for bit.

The documented meaning, and where it comes from:

* updates are applied locally in each process (DESIGN.md); with
  ``num_slices`` > 1 each slice is computed from the original values and the
  slices' update values are combined with the update's op (``avg`` weighted by
  the slices' rows; the ``avg`` of slices that all hold the same bits is that
  value, in avg's dtype) and cast into the variable's dtype, integers rounded
  (docs/tutorial.rst, "What a call returns");
* output ops combine the processes in rank order; ``avg`` weighs each process
  by its rows (the ``combine`` recipe of synkhronos/collectives/ops.py:
  equal weights are a sum times the reciprocal of the count, unequal ones
  the sum of each part times its share of the rows); ``gather`` concatenates
  in rank order; ``None`` is the master's own result;
* collectives (docs/shared.rst and the docstrings of synkhronos/_shareds/api.py):
  reductions fold in rank order, ``avg`` is the sum times the reciprocal of
  the count, integers and booleans in float64 and rounded (ties to even);
  a collective that raises (``ValueError`` for shapes that differ, a 0-d
  variable where one is not allowed; ``TypeError`` for a lossy value) changes
  no process's copy; values are cast as PyTensor's ``set_value`` casts them;
  every returned array is new memory that nothing writes afterwards;
* a process with no rows in a call computes nothing (no outputs, no updates),
  except the master of a call with no rows at all (tests/test_properties.py);
  a ``None`` output is then None when the master has no rows (master_rank > 0);
* a call that fails in some processes (docs/internals.rst, "What a failed call
  does to the shared variables", and ``Function.__call__``): every process
  applies its updates exactly when its own share ran without error, the
  master included;
* ``Function.as_pytensor`` runs the plain function in the master only; its
  updates apply to the master's copies; a plain ``set_value`` on a shared
  variable touches the master's copy only (docs/shared.rst).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import traceback
from typing import Any

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.raise_op import Assert

import synkhronos as synk
from conftest import MODE
from synkhronos._batching import split

#: How often a step of each kind is drawn (relative weights).
KINDS = {
    "call_main": 14, "call_bc": 4, "call_swap": 4, "call_momentum": 4, "call_fail": 3,
    "call_givens": 2, "call_sliced": 4, "call_fast": 4, "call_scale": 3, "call_tiny": 1, "call_late": 2,
    "broadcast": 6, "scatter": 5, "gather": 6, "all_gather": 4, "reduce": 6, "all_reduce": 9,
    "set_value": 9, "get_value": 2, "get_shapes": 2, "master_set": 3, "as_pytensor": 3,
    "data_resize": 3, "data_write": 3, "new_fn": 1, "refork": 0.12, "misuse": 1.5,
}
#: Late functions (built after distribute()) a world makes at most.
MAX_LATE = 6
#: An all_gather whose result would pass this many bytes first gives those variables new
#: values of their usual sizes: each all_gather multiplies a variable's length by n, so
#: without it a long run at 5 processes grows one variable past the machine's memory.
ALL_GATHER_CAP = 16 << 20
#: Returned arrays kept to check that nothing writes them afterwards.
KEEP_RETURNED = 8
#: A marker that makes the failing function's Assert fail (in the rows of a chosen rank).
FAIL_MARK = 5000.0

# Lengths that put values on both sides of the sizes the library switches at:
# 256 B, 8 KiB (reply areas), 64 KiB (inline collectives), 256 KiB (chunked reductions).
SIZE_POOLS = {
    "Z64": [0, 1, 5, 31, 32, 33, 1023, 1024, 1025, 8191, 8192, 8193, 8700, 32767, 32769],
    "Z32": [0, 1, 15, 16, 17, 511, 512, 513, 4095, 4096, 4097, 4400, 16383, 16385],
    "Zi": [0, 1, 63, 64, 65, 2047, 2048, 2049, 16383, 16384, 16385, 17400],
    "Zb": [0, 1, 255, 256, 257, 8191, 8192, 8193, 65535, 65536, 65537, 70000],
}
#: The world's own variables (tests/model_lib.py World._make_vars), in order.
BASE_VARS = ["acc", "cnt", "B", "C", "prev", "w", "G", "H", "S", "T", "Z64", "Z32", "Zi", "Zb", "Z0", "Zi0", "Ze"]
#: The length most values of these variables have (the functions using them need it).
USUAL = {"acc": 3, "B": 4, "C": 4, "prev": 3, "w": 3, "G": 2, "H": 2, "T": 2}
#: The variable lists a training loop would use again and again (the library keeps plans
#: per list): those a function uses together, in both orders.
FAVOURITES = [["B", "C"], ["C", "B"], ["prev", "w"], ["w", "prev"], ["acc"], ["acc", "cnt"], ["Z64"],
              ["Z32", "Zi", "Zb"], ["G", "H", "T"], ["S"], ["B"], ["w"], ["Z0", "Zi0"], ["Ze", "Z64"]]
#: Columns of the main function's input: outputs below and above 8 KiB a process.
MAIN_COLS = [1, 3, 3, 3, 40, 1100]
LRS = [0.5, 2.0, 1.0, -0.25]
REDUCE_OPS = ["avg", "sum", "prod", "max", "min"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One random step: what it does is drawn from ``seed`` and the model's state."""

    kind: str
    seed: int
    gap_ms: int = 0

    def __repr__(self) -> str:
        gap = f", gap_ms={self.gap_ms}" if self.gap_ms else ""
        return f"Step({self.kind!r}, {self.seed}{gap})"


class ModelMismatch(AssertionError):
    """synkhronos and the model disagree; ``category`` says how."""

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


def random_steps(seed: int, count: int, kinds=None) -> list:
    """``count`` random steps (kinds drawn by KINDS' weights; idle gaps of 0, 1 or 50 ms)."""
    rng = np.random.default_rng(seed)
    weights = dict(KINDS if kinds is None else kinds)
    names = list(weights)
    p = np.array([weights[k] for k in names], dtype=float)
    p /= p.sum()
    picks = rng.choice(len(names), size=count, p=p)
    gaps = rng.choice([0, 1, 50], size=count, p=[0.93, 0.06, 0.01])
    seeds = rng.integers(0, 2**31 - 1, size=count)
    steps = [Step(names[k], int(s), int(g)) for k, s, g in zip(picks, seeds, gaps)]
    if count >= 10:  # the 300 tiny variables make every check slower: for the last 40 % of a run
        at = int(0.6 * count)
        steps[at] = Step("make_tiny", steps[at].seed, steps[at].gap_ms)
    return steps


# ---------------------------------------------------------------------------
# values


def val(dtype, shape, seed: int, exact: bool = False) -> np.ndarray:
    """A reproducible random value. ``exact``: small integers (as ``dtype``), so
    that sums inside a graph are exact in any order."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    if dtype.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind in "iu" or exact:
        lo = 0 if dtype.kind == "u" else -3
        return np.asarray(rng.integers(lo, 4, size=shape)).astype(dtype)
    out = np.asarray(rng.standard_normal(shape) * 4).astype(dtype)
    if out.size and rng.random() < 0.1:  # now and then the odd float
        flat = out.reshape(-1)
        flat[rng.integers(flat.size)] = rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-300])
    return out


def _show(a) -> str:
    """How a step's log shows a value."""
    if isinstance(a, synk.Data):
        return f"<synk.data {a.dtype} {a.shape}>"
    a = np.asarray(a)
    if a.size <= 6:
        return f"np.array({a.tolist()!r}, {a.dtype.name!r})"
    return f"<{a.dtype.name} {a.shape}>"


def select(value, batch):
    """The rows ``batch`` picks: an int is the first rows, else numpy indexing."""
    if batch is None:
        return value
    if isinstance(batch, int):
        return value[:batch]
    return value[np.asarray(batch, dtype=np.int64) if isinstance(batch, list) else batch]


def _f64(x):
    return pt.constant(np.float64(x), dtype="float64")


def _show_batch(b) -> str:
    if isinstance(b, np.ndarray):
        return f"np.array({b.tolist()!r})" if b.size <= 12 else f"<int64 index array of {b.size}>"
    if isinstance(b, list) and any(isinstance(x, (slice, np.ndarray)) for x in b):
        return "[" + ", ".join(_show_batch(x) for x in b) + "]"
    return repr(b)


# ---------------------------------------------------------------------------
# the reference arithmetic


_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _over_slices(parts, op: str, weights) -> np.ndarray:
    """One process's slices combined (docs/tutorial.rst): as :func:`combine`, except that the
    ``avg`` of slices that all hold the same bits is that value (in avg's result dtype)."""
    first = np.asarray(parts[0])
    if op == "avg" and all(np.asarray(p).dtype == first.dtype and np.asarray(p).shape == first.shape
                           and np.asarray(p).tobytes() == first.tobytes() for p in parts[1:]):
        return first.astype(np.float64 if first.dtype.kind in "biu" else first.dtype)
    return combine(parts, op, weights)


def combine(parts, op: str, weights=None) -> np.ndarray:
    """``parts`` combined by ``op`` in rank order, as documented for outputs and
    num_slices: avg in float64 for integers, weights as fractions of their total
    (equal ones: the sum times the reciprocal; unequal: the sum of each part times
    its fraction)."""
    parts = [np.asarray(p) for p in parts]
    n = len(parts)
    if op == "gather" or op is None:
        return np.concatenate(parts, axis=0)
    if n == 1:
        p = parts[0]
        if op == "avg" and p.dtype.kind in "biu":
            return p.astype(np.float64)
        return np.array(p, copy=True)
    if op != "avg":
        return np.asarray(functools.reduce(_UFUNCS[op], parts))
    work = np.dtype(np.float64) if parts[0].dtype.kind in "biu" else parts[0].dtype
    parts = [p.astype(work) for p in parts]
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    total = sum(w)
    w = [x / total for x in w] if total > 0 else [1.0 / n] * n
    scales = [work.type(x) for x in w]
    if w.count(w[0]) == n:
        return np.asarray(functools.reduce(np.add, parts) * scales[0])
    acc = np.asarray(parts[0] * scales[0])
    for p, s in zip(parts[1:], scales[1:]):
        acc = np.asarray(acc + p * s)
    return acc


def reduce_collective(parts, op: str, dtype) -> np.ndarray:
    """What reduce/all_reduce store in a variable of ``dtype``: a fold in rank order;
    avg as the sum times the reciprocal of the count (integers in float64), rounded
    into integers (also tests/test_small_collectives.py's recipe)."""
    if op != "avg":
        return np.asarray(functools.reduce(_UFUNCS[op], parts)).astype(dtype)
    work = np.dtype(dtype) if np.dtype(dtype).kind == "f" else np.dtype(np.float64)
    total = functools.reduce(np.add, [np.asarray(p, dtype=work) for p in parts])
    mean = np.asarray(total * work.type(1.0 / len(parts)))
    if np.dtype(dtype).kind != "f":
        mean = mean.round()
    return mean.astype(dtype)


def cast_into(value, dtype) -> np.ndarray:
    """A value stored into a variable of ``dtype``: floats into integers rounded."""
    value = np.asarray(value)
    dtype = np.dtype(dtype)
    if value.dtype == dtype:
        return value
    if dtype.kind in "biu" and value.dtype.kind == "f":
        value = value.round()
    return value.astype(dtype)


def same(a, b) -> bool:
    """Bit for bit: type, dtype, shape and bytes."""
    return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            and a.tobytes() == b.tobytes())


def _describe_diff(want: np.ndarray, got) -> str:
    if not isinstance(got, np.ndarray):
        return f"expected an ndarray {want.dtype} {want.shape}, got {type(got).__name__}: {got!r}"[:2000]
    lines = [f"expected {want.dtype} {want.shape}, got {got.dtype} {got.shape}"]
    with np.printoptions(threshold=12, edgeitems=3, precision=17):
        lines.append(f"  expected: {want!r}")
        lines.append(f"  got:      {got!r}")
    if want.shape == got.shape and want.dtype == got.dtype and want.size:
        width = want.dtype.itemsize
        a = np.frombuffer(want.tobytes(), np.uint8).reshape(-1, width)
        b = np.frombuffer(got.tobytes(), np.uint8).reshape(-1, width)
        differ = np.flatnonzero((a != b).any(axis=1))
        lines.append(f"  {len(differ)} of {want.size} elements differ, the first at flat index {differ[:5].tolist()}")
    if got.size and got.dtype.kind in "iuf" and (got == 77).all() and not (want == 77).all():
        lines.append("  (77 is what the test writes into every returned array, input and value it passed "
                     "once it is done with it: this memory is shared with one of them)")
    try:
        np.testing.assert_array_equal(got, want)
    except AssertionError as err:
        lines.append("  " + str(err).strip().replace("\n", "\n  ")[:1500])
    return "\n".join(lines)


def _scribble(a) -> None:
    """Write garbage into an array the user owns now (a returned value, an input)."""
    if isinstance(a, np.ndarray) and a.size and a.flags.writeable:
        if a.dtype.kind == "b":
            a[...] = ~a
        else:
            a[...] = 77


# ---------------------------------------------------------------------------
# the world: variables, functions, data, and the model of every process's copies


@dataclasses.dataclass
class Var:
    name: str
    var: Any
    dtype: np.dtype
    ndim: int
    exact: bool = False     # integer values only, no avg/sum/prod (a graph sums it)
    group: str = "base"     # "base", "tiny" or "late"


class World:
    """One fork with its shared variables, functions and synk.data, and the model.

    ``fork_fn(n)`` starts a fork of ``n`` processes. The 300 tiny variables and
    their function come with a ``make_tiny`` step (compiling them is slow, and
    they make every check slower).
    """

    def __init__(self, n: int, fork_fn, master: int = 0):
        self.n = n
        self.master = master
        # (one fork: the rank whose copies a broadcast without values sends, and every
        # master; across nodes, tests/mpi/model_nodes.py: node 0's master, each node's)
        self.root = master
        self.masters = [master]
        self.fork_fn = fork_fn
        self.with_tiny = False
        self.log: list[str] = []
        self.returned: list = []  # (array, its bytes, where it came from)
        self.n_returned = 0
        self.vars: dict[str, Var] = {}
        self.model: list[dict] = [{} for _ in range(n)]
        self.data_model: dict[str, np.ndarray] = {}
        self.late: list = []  # (name of the variable, name of the function)
        self.fork_fn(n, master_rank=master)
        self._make_vars()
        self._build_functions()
        self._make_data()
        self._say("synk.distribute()")
        synk.distribute()

    # -- building --------------------------------------------------------

    def _add_var(self, name, value, exact=False, group="base") -> Var:
        value = np.asarray(value)
        v = Var(name, pytensor.shared(value.copy(), name=name), value.dtype, value.ndim, exact, group)
        self.vars[name] = v
        for r in range(self.n):
            self.model[r][name] = value.copy()
        return v

    def _make_vars(self) -> None:
        self._add_var("acc", np.zeros(3))
        self._add_var("cnt", np.int64(0))
        self._add_var("B", np.ones(4, "float32"))
        self._add_var("C", np.full(4, 2, "float32"))
        self._add_var("prev", np.zeros(3))
        self._add_var("w", np.zeros(3))
        self._add_var("G", np.zeros(2))
        self._add_var("H", np.arange(2.0))
        self._add_var("S", val("float64", (6, 2), 1, exact=True), exact=True)
        self._add_var("T", np.zeros(2))
        self._add_var("Z64", val("float64", (40,), 2))
        self._add_var("Z32", val("float32", (20, 4), 3))
        self._add_var("Zi", val("int32", (70,), 4))
        self._add_var("Zb", val("bool", (300,), 5))
        self._add_var("Z0", np.float32(1.5))
        self._add_var("Zi0", np.int64(7))
        self._add_var("Ze", np.zeros((0, 3)))
        self.orphan = pytensor.shared(np.zeros(2), name="orphan")  # in no function: not in the workers

    def _v(self, name):
        return self.vars[name].var

    def _build_functions(self) -> None:
        """Every function, in a fixed order (again after a new fork)."""
        v = self._v
        x, lr = pt.dmatrix("x"), pt.dscalar("lr")
        s0 = x.sum(axis=0)
        self.f_main = synk.function(
            [x, lr],
            [(s0 * lr, "avg"), (s0, "sum"), (pt.switch(pt.gt(x, 0), _f64(2.0), _f64(0.5)).prod(axis=0), "prod"),
             (x.max(axis=0), "max"), (x.min(axis=0), "min"), (x * lr, "gather"), (x + 1, None),
             (pt.cast(s0, "int64"), "avg"),
             # 40 copies: above 256 KiB a process with 1100 columns (reduced in chunks)
             (pt.concatenate([s0] * 40), "avg")],
            bcast_inputs=[lr], updates=[(v("acc"), v("acc") + x.sum() * lr), (v("cnt"), v("cnt") + 1)],
            mode=MODE, name="f_main")
        x2, y, k = pt.dmatrix("x"), pt.dvector("y"), pt.lscalar("k")
        self.f_bc = synk.function([x2, y, k],
                                  [(x2.dot(y) * k, "gather"), (y * k, "max"), (x2.sum(axis=0) * k, "c_sum")],
                                  bcast_inputs=[y, k], mode=MODE, name="f_bc")
        B, C = v("B"), v("C")
        self.f_swap = synk.function([], [(B * 1, "gather")], updates=[(B, C), (C, B)], mode=MODE, name="f_swap")
        prev, w = v("prev"), v("w")
        self.f_momentum = synk.function([], [], updates=[(prev, w), (w, w + 1)], mode=MODE, name="f_momentum")
        # compiled with PyTensor's optimisations: its updates run in place, and one
        # variable's old storage is handed to another (B's, doubled in place, becomes C's)
        self.f_fast = synk.function([], [(w * 1.0, "gather")],
                                    updates=[(prev, w * 2.0), (w, w + prev), (B, C), (C, B * np.float32(2))],
                                    mode="FAST_RUN", name="f_fast")
        x3 = pt.dmatrix("x")
        checked = Assert("marker row")(x3, pt.all(pt.lt(x3, 1000)))
        self.f_fail = synk.function([x3], [(checked.sum(axis=0), "sum")],
                                    updates=[(v("acc"), v("acc") + x3.sum()), (v("cnt"), v("cnt") + 1)],
                                    mode=MODE, name="f_fail")
        g = pt.dvector("g")
        self.f_givens = synk.function([], [(g * 1, "gather")], updates=[(v("G"), v("G") + g)],
                                      givens=[(g, v("H") * 2.0)], mode=MODE, name="f_givens")
        S, T = v("S"), v("T")
        self.f_sliced = synk.function([], [(S.sum(axis=0), "sum"), (S.sum(axis=0), "avg")],
                                      updates=[(T, T + S.sum(axis=0), "max")], sliceable_shareds=[S],
                                      mode=MODE, name="f_sliced")
        Z64, Z32 = v("Z64"), v("Z32")
        # the other size variables ride along, so that the workers hold them
        holders = [v(nm) for nm in ("Zi", "Zb", "Z0", "Zi0", "Ze")]
        self.f_scale = synk.function([], [(Z64.shape[0], "sum")] + [(h.shape[0] if h.ndim else h * 1, "max")
                                                                  for h in holders],
                                     updates=[(Z64, Z64 * 2.0), (Z32, Z32 + 1)], mode=MODE, name="f_scale")
        if self.with_tiny:
            self._tiny_function()
        self.late_fns = {}
        for vname, fname in self.late:
            self.late_fns[fname] = self._late_function(vname, fname)

    def _tiny_function(self) -> None:
        tiny = [self.vars[f"t{i}"] for i in range(300)]
        self.f_tiny = synk.function(
            [], [(tiny[0].var * 1, "gather")],
            updates=[(t.var, t.var + np.asarray(1, t.dtype)) for t in tiny], mode=MODE, name="f_tiny")

    def _late_function(self, vname, fname):
        t = self.vars[vname]
        cnt = self._v("cnt")
        upd = t.var + (cnt if t.dtype.kind == "i" else pt.cast(cnt, t.dtype.name))
        return synk.function([], [(t.var * 1, "gather")], updates=[(t.var, upd)], mode=MODE, name=fname)

    def _make_data(self) -> None:
        """synk.data inputs: a matrix for x, 0-d lr and k, a vector for y."""
        self.data = {}
        contents = {"dX": val("float64", (9, 3), 11, exact=True), "dlr": np.array(0.5),
                    "dY": val("float64", (3,), 12, exact=True), "dK": np.array(2, "int64")}
        for name, value in contents.items():
            value = self.data_model.get(name, value)
            self.data[name] = synk.data(value, name=name)
            self.data_model[name] = np.array(value, copy=True)

    # -- bookkeeping ----------------------------------------------------

    def _say(self, line: str) -> None:
        self.log.append(line)

    def all_names(self) -> list:
        return list(self.vars)

    def taking_part(self) -> list:
        """The ranks that take part in collectives and calls now (across nodes: not those
        of a node that has joined)."""
        return list(range(self.n))

    def shapes(self, name) -> list:
        return [self.model[r][name].shape for r in self.taking_part()]

    def equal_shapes(self, name) -> bool:
        return len(set(self.shapes(name))) == 1

    def expect(self, what: str, want, got) -> None:
        """A returned value against the model, bit for bit; then kept or scribbled."""
        want = np.asarray(want)
        if not same(want, got):
            raise ModelMismatch("return", f"{what}: {_describe_diff(want, got)}")
        self._returned(got, what)

    def _returned(self, got, what) -> None:
        if not isinstance(got, np.ndarray) or not got.size:
            return
        self.n_returned += 1
        if self.n_returned % 3 == 0:  # kept (the last few) and checked to stay as returned
            self.returned = self.returned[-(KEEP_RETURNED - 1):] + [(got, got.tobytes(), what)]
        else:  # or written: nothing else may hold it
            _scribble(got)

    def check_state(self) -> None:
        """Every process's copy of every variable, one get_value command per rank;
        the master's own copies; the kept returned arrays unchanged."""
        names = self.all_names()
        vars_ = [self.vars[nm].var for nm in names]
        for r in self.taking_part():
            got = synk.get_value(r, vars_)
            if not isinstance(got, tuple) or len(got) != len(names):
                raise ModelMismatch("state", f"get_value({r}, [{len(names)} variables]) returned {type(got)}")
            for nm, g in zip(names, got):
                want = self.model[r][nm]
                if not same(want, g):
                    raise ModelMismatch("state", f"rank {r}'s copy of {nm}: {_describe_diff(want, g)}")
            for g in got:  # copies, the caller's to write
                _scribble(g)
        for nm, v in zip(names, vars_):
            g = v.get_value(borrow=True)
            if not same(self.model[self.master][nm], g):
                raise ModelMismatch("state", f"the master's own {nm}.get_value(): "
                                             f"{_describe_diff(self.model[self.master][nm], g)}")
        for arr, snapshot, what in self.returned:
            if arr.tobytes() != snapshot:
                raise ModelMismatch("return-changed", f"an array returned earlier ({what}) changed afterwards")

    # -- choosing --------------------------------------------------------

    def extra_favourites(self) -> list:
        """Favourite lists of the variables made by steps (tiny and late ones)."""
        groups = []
        if self.with_tiny:
            groups += [[f"t{i}" for i in range(0, 51, 3)], [f"t{i}" for i in range(300)]]
        for vname, _ in self.late:
            groups += [[vname], [vname, "cnt"]]
        return groups

    def pick_vars(self, rng, need_ndim=0, allow_tiny=True) -> list:
        """Names of variables: mostly one of the favourite lists (FAVOURITES), else 1-4
        distinct ones, or 17-300 tiny ones, in random order. One draw from ``rng``, and
        the choice among the world's own variables does not depend on what later steps
        made (tiny and late variables are picked in branches of their own): a step
        deleted by the minimiser changes the choices of the others as little as possible."""
        sub = np.random.default_rng(int(rng.integers(2**63 - 1)))
        u_fav, u_extra = sub.random(), sub.random()
        i_base, i_extra = int(sub.integers(1 << 30)), int(sub.integers(1 << 30))
        ok = lambda names: all(self.vars[nm].ndim >= need_ndim for nm in names)  # noqa: E731
        if u_fav < 0.5:
            extra = [g for g in self.extra_favourites() if ok(g)
                     and (allow_tiny or self.vars[g[0]].group != "tiny")]
            if extra and u_extra < 0.25:
                return list(extra[i_extra % len(extra)])
            base = [g for g in FAVOURITES if ok(g)]
            return list(base[i_base % len(base)])
        pool = [nm for nm in BASE_VARS if ok([nm])]
        k = int(sub.choice([1, 1, 1, 2, 2, 3, 4]))
        names = [pool[i] for i in sub.choice(len(pool), size=min(k, len(pool)), replace=False)]
        tiny = [nm for nm, v in self.vars.items() if v.group == "tiny" and v.ndim >= need_ndim]
        late = [nm for nm, v in self.vars.items() if v.group == "late" and v.ndim >= need_ndim]
        if allow_tiny and tiny and u_extra < 0.12:
            size = min(len(tiny), int(sub.choice([17, 33, 257, 300])))
            group = [tiny[i] for i in sub.choice(len(tiny), size=size, replace=False)]
            return group + names[: i_base % 3]
        if late and u_extra > 0.8:
            names[i_base % len(names)] = late[i_extra % len(late)]
        return list(dict.fromkeys(names))

    def new_shape(self, name, rng, lead=None) -> tuple:
        """A shape for a new value of ``name``: its usual one mostly, sometimes another;
        ``lead`` fixes the length of axis 0."""
        v = self.vars[name]
        if v.ndim == 0:
            return ()
        usual = USUAL
        trailing = {"S": (2,), "Z32": (4,), "Ze": (3,)}
        if lead is None:
            if name in SIZE_POOLS:
                lead = int(rng.choice(SIZE_POOLS[name]))
            elif name in usual and rng.random() < (0.95 if name == "T" else 0.8):
                lead = usual[name]
            elif name == "S":  # f_sliced needs rows in every process
                lead = int(rng.choice([0, 1, 2, 3, 5, 8], p=[0.04, 0.32, 0.16, 0.16, 0.16, 0.16]))
            elif name == "Ze":
                lead = int(rng.choice([0, 0, 1, 2]))
            else:
                lead = int(rng.choice([0, 1, 2, 3, 5, 8]))
        if name in trailing:
            return (lead,) + trailing[name]
        first = self.model[self.master][name]
        return (lead,) + first.shape[1:]

    def new_value(self, name, rng, lead=None):
        """``(value, log text)`` for a new value of ``name``."""
        v = self.vars[name]
        shape = self.new_shape(name, rng, lead)
        seed = int(rng.integers(2**31 - 1))
        return val(v.dtype, shape, seed, exact=v.exact), f"val({v.dtype.name!r}, {shape}, {seed}" + \
            (", exact=True)" if v.exact else ")")

    def as_given(self, name, value, rng):
        """``(what to pass, the value the variable will hold)``: the value itself, a
        synk.data of it, or the value in a smaller dtype that casts safely
        (PyTensor's set_value rule)."""
        v = self.vars[name]
        r = rng.random()
        if r < 0.15 and value.ndim:
            return synk.data(value), value
        if r < 0.15:  # a 0-d value as a numpy scalar
            return value[()], value
        if r < 0.25 and v.dtype.kind in "fi" and v.dtype.itemsize > 1:
            if v.dtype == np.float64:
                small = value.astype(np.float32)
            else:
                small = np.asarray(np.clip(np.nan_to_num(value), -100, 100).round()).astype(np.int8)
            return small, small.astype(v.dtype)
        return value, value

    def _reduce_collective(self, parts: dict, op: str, dtype) -> np.ndarray:
        """What reduce/all_reduce store, of ``parts`` (rank: value, of every rank taking
        part, in rank order; :func:`reduce_collective`)."""
        return reduce_collective(list(parts.values()), op, dtype)

    def _given(self, values):
        """The values this master passes to a collective that takes values (across nodes
        only node 0's count: the others may pass None, or anything)."""
        return values

    def _shapes_refused(self, names):
        """What a collective that needs equal shapes raises when ``names`` differ between ranks."""
        return ValueError

    def _values_refused(self, exc_type):
        """What a collective raises when the values it takes are refused (across nodes:
        node 0's are taken, so the other nodes hear of node 0's error)."""
        return exc_type

    def _own_batch_s(self, batch_s):
        """What this master passes as ``batch_s`` (across nodes: its own processes' entries)."""
        return batch_s

    def master_of(self, rank: int) -> int:
        """The master of ``rank``'s fork (across nodes: its node's master)."""
        return self.master

    def set_model(self, rank, name, value) -> None:
        self.model[rank][name] = np.array(cast_into(value, self.vars[name].dtype), copy=True)

    # -- the step --------------------------------------------------------

    def apply(self, step: Step) -> None:
        rng = np.random.default_rng(step.seed)
        with np.errstate(all="ignore"):  # products overflow, NaNs compare: both sides alike
            getattr(self, "do_" + step.kind)(rng)

    def close(self) -> None:
        synk.close()

    # -- collectives -----------------------------------------------------

    def _arg(self, names, bare_ok=True, rng=None):
        """``(argument, text, single)``: one variable bare (sometimes), or a list (or tuple)."""
        if len(names) == 1 and bare_ok and rng is not None and rng.random() < 0.5:
            return self._v(names[0]), names[0], True
        if rng is not None and rng.random() < 0.15:
            return tuple(self._v(nm) for nm in names), "(" + ", ".join(names) + ",)", False
        return [self._v(nm) for nm in names], "[" + ", ".join(names) + "]", False

    def _expect_error(self, exc_type, fn, what) -> None:
        try:
            fn()
        except exc_type:
            return
        except Exception as err:
            raise ModelMismatch("raise", f"{what}: expected {exc_type.__name__}, got "
                                         f"{type(err).__name__}: {err}") from err
        raise ModelMismatch("no-raise", f"{what}: expected {exc_type.__name__}, nothing was raised")

    def _check_results(self, what, got, wants, single) -> None:
        if single:
            self.expect(what, wants[0], got)
            return
        if not isinstance(got, tuple) or len(got) != len(wants):
            raise ModelMismatch("return", f"{what}: expected a tuple of {len(wants)}, got {type(got).__name__}")
        for i, (g, want) in enumerate(zip(got, wants)):
            self.expect(f"{what} [{i}]", want, g)

    def _values_arg(self, names, rng, lead_for=None):
        """New values for ``names``: ``(passed, held, text)``."""
        passed, held, texts = [], [], []
        for nm in names:
            lead = None if lead_for is None else lead_for(nm)
            value, text = self.new_value(nm, rng, lead)
            given, kept = self.as_given(nm, value, rng)
            passed.append(given)
            held.append(kept)
            texts.append(text if given is value else f"{text}.astype({np.asarray(given).dtype.name!r})"
                         if isinstance(given, np.ndarray) else f"{text}[()]" if isinstance(given, np.generic)
                         else f"synk.data({text})")
        return passed, held, texts

    def _lossy(self, names, rng):
        """A value that ``names[0]`` cannot hold without loss, or None."""
        v = self.vars[names[0]]
        shape = self.new_shape(names[0], rng)
        if v.dtype.kind in "iu":
            return np.full(shape, 1.7)
        if v.dtype == np.float32:
            return np.full(shape, 0.1, dtype=np.float64)
        return None

    def do_broadcast(self, rng) -> None:
        names = self.pick_vars(rng)
        arg, text, single = self._arg(names, rng=rng)
        if rng.random() < 0.5:
            self._say(f"synk.broadcast({text})")
            synk.broadcast(arg)
            for nm in names:
                for r in self.taking_part():
                    self.model[r][nm] = self.model[self.root][nm].copy()
            return
        if rng.random() < 0.05 and self._lossy(names, rng) is not None:
            bad = [self._lossy(names, rng)] + [self.model[self.master][nm] for nm in names[1:]]
            self._say(f"synk.broadcast({text}, <a lossy value>)  # TypeError")
            self._expect_error(self._values_refused(TypeError), lambda: synk.broadcast(arg, bad[0] if single else bad),
                               "broadcast of a value the variable cannot hold")
            return
        passed, held, texts = self._values_arg(names, rng)
        self._say(f"synk.broadcast({text}, " + (texts[0] if single else "[" + ", ".join(texts) + "]") + ")")
        synk.broadcast(arg, self._given(passed[0] if single else passed))
        for nm, value in zip(names, held):
            for r in self.taking_part():
                self.set_model(r, nm, value)
        for p in passed:
            _scribble(p)

    def do_scatter(self, rng) -> None:
        names = self.pick_vars(rng, need_ndim=1)
        if rng.random() < 0.03:
            zero_d = [nm for nm, v in self.vars.items() if v.ndim == 0 and v.group == "base"]
            nm = zero_d[int(rng.integers(len(zero_d)))]
            self._say(f"synk.scatter({nm}, np.float64(1))  # ValueError: 0-d")
            self._expect_error(ValueError, lambda: synk.scatter(self._v(nm), np.asarray(1, self.vars[nm].dtype)),
                               "scatter of a 0-d variable")
            return
        arg, text, single = self._arg(names, rng=rng)
        n = self.n

        def lead(nm):
            if nm in SIZE_POOLS and rng.random() < 0.5:
                return int(rng.choice(SIZE_POOLS[nm]))
            if nm == "S" and rng.random() < 0.9:  # f_sliced needs rows in every process
                return int(rng.integers(n, 4 * n + 1))
            if nm in USUAL and rng.random() < 0.7:  # each process its usual length
                return USUAL[nm] * n
            return int(rng.integers(0, 3 * n + 3))
        passed, held, texts = self._values_arg(names, rng, lead)
        batch = None
        if rng.random() < 0.3:
            batch = self._random_batch(rng, min(len(h) for h in held))
        self._say(f"synk.scatter({text}, " + (texts[0] if single else "[" + ", ".join(texts) + "]")
                  + (f", batch={_show_batch(batch)}" if batch is not None else "") + ")")
        synk.scatter(arg, self._given(passed[0] if single else passed), batch=batch)
        for nm, value in zip(names, held):
            chosen = select(value, batch)
            for r in range(n):
                lo, hi = split(len(chosen), n, r)
                self.set_model(r, nm, chosen[lo:hi])
        for p in passed:
            _scribble(p)

    def _random_batch(self, rng, length):
        """A ``batch`` for values of ``length`` rows: an int, a slice or an index list."""
        kind = rng.random()
        if kind < 0.3:
            return int(rng.integers(0, length + 1))
        if kind < 0.6:
            a = int(rng.integers(0, length + 1))
            b = int(rng.integers(a, length + 1))
            return slice(a, b, int(rng.choice([1, 1, 2, 3])))
        if length == 0:
            return np.zeros(0, np.int64)
        idx = rng.integers(-length, length, size=int(rng.integers(0, 2 * length + 1)))
        return idx if rng.random() < 0.7 else idx.tolist()

    def do_gather(self, rng) -> None:
        names = self.pick_vars(rng)
        nd_up = int(rng.integers(0, 2))
        arg, text, single = self._arg(names, rng=rng)
        self._say(f"synk.gather({text}, nd_up={nd_up})")
        if nd_up == 1 and not all(self.equal_shapes(nm) for nm in names):
            self._expect_error(ValueError, lambda: synk.gather(arg, nd_up=1), "gather(nd_up=1) of unequal shapes")
            return
        if nd_up == 0 and any(self.vars[nm].ndim == 0 for nm in names):
            self._expect_error(ValueError, lambda: synk.gather(arg, nd_up=0), "gather(nd_up=0) of a 0-d variable")
            return
        got = synk.gather(arg, nd_up=nd_up)
        wants = []
        for nm in names:
            parts = [self.model[r][nm] for r in self.taking_part()]
            wants.append(np.stack(parts) if nd_up else np.concatenate(parts, axis=0))
        self._check_results(f"gather({text}, nd_up={nd_up})", got, wants, single)

    def do_all_gather(self, rng) -> None:
        names = self.pick_vars(rng)
        arg, text, single = self._arg(names, rng=rng)
        self._say(f"synk.all_gather({text})")
        if any(self.vars[nm].ndim == 0 for nm in names):
            self._expect_error(ValueError, lambda: synk.all_gather(arg), "all_gather of a 0-d variable")
            return
        self._cap_growth(names, rng)
        got = synk.all_gather(arg)
        part = self.taking_part()
        wants = [np.concatenate([self.model[r][nm] for r in part], axis=0) for nm in names]
        for nm, want in zip(names, wants):
            for r in part:
                self.model[r][nm] = want.copy()
        self._check_results(f"all_gather({text})", got, wants, single)

    def _cap_growth(self, names, rng) -> None:
        """Broadcast new values (usual sizes) to those of ``names`` whose all_gather would
        pass ALL_GATHER_CAP bytes (drawing from ``rng`` once either way; logged as a step)."""
        sub = np.random.default_rng(int(rng.integers(2**63 - 1)))
        part = self.taking_part()
        big = [nm for nm in names if sum(self.model[r][nm].nbytes for r in part) > ALL_GATHER_CAP]
        if not big:
            return
        made = [self.new_value(nm, sub) for nm in big]
        self._say(f"synk.broadcast([{', '.join(big)}], [" + ", ".join(text for _, text in made) + "])"
                  "  # smaller values: this all_gather would pass ALL_GATHER_CAP")
        synk.broadcast([self._v(nm) for nm in big], [value for value, _ in made])
        for nm, (value, _) in zip(big, made):
            for r in part:
                self.set_model(r, nm, value)

    def _reduce_op(self, names, rng) -> tuple:
        """``(op as given, op)``: the given one sometimes ``c_``-prefixed (the CPU path: the same here)."""
        op = str(rng.choice(["max", "min"] if any(self.vars[nm].exact for nm in names) else REDUCE_OPS))
        return ("c_" + op if rng.random() < 0.1 else op), op

    def do_reduce(self, rng) -> None:
        names = self.pick_vars(rng)
        given, op = self._reduce_op(names, rng)
        in_place = bool(rng.random() < 0.5)
        arg, text, single = self._arg(names, rng=rng)
        self._say(f"synk.reduce({text}, op={given!r}, in_place={in_place})")
        if not all(self.equal_shapes(nm) for nm in names):
            self._expect_error(self._shapes_refused(names), lambda: synk.reduce(arg, op=given, in_place=in_place),
                               "reduce of shapes that differ")
            return
        got = synk.reduce(arg, op=given, in_place=in_place)
        part = self.taking_part()
        wants = [self._reduce_collective({r: self.model[r][nm] for r in part}, op, self.vars[nm].dtype)
                 for nm in names]
        if in_place:
            if got is not None:
                raise ModelMismatch("return", f"reduce(in_place=True) returned {type(got).__name__}, not None")
            for nm, want in zip(names, wants):
                for m in (m for m in self.masters if m in part):  # (every node's master, across nodes)
                    self.model[m][nm] = want.copy()
        else:
            # every result is an ndarray (0-d values too), in the variable's dtype
            for g in (got,) if single else got:
                if type(g) is not np.ndarray:
                    raise ModelMismatch("return", f"reduce(in_place=False) returned {type(g).__name__} {g!r}, "
                                        "not an ndarray")
            self._check_results(f"reduce({text}, {op!r}, in_place=False)", got, wants, single)

    def do_all_reduce(self, rng, names=None) -> None:
        names = self.pick_vars(rng) if names is None else names
        given, op = self._reduce_op(names, rng)
        arg, text, single = self._arg(names, rng=rng)
        self._say(f"synk.all_reduce({text}, op={given!r})")
        if not all(self.equal_shapes(nm) for nm in names):
            self._expect_error(self._shapes_refused(names), lambda: synk.all_reduce(arg, op=given),
                               "all_reduce of shapes that differ")
            return
        got = synk.all_reduce(arg, op=given)
        if got is not None:
            raise ModelMismatch("return", f"all_reduce returned {type(got).__name__}, not None")
        part = self.taking_part()
        for nm in names:
            want = self._reduce_collective({r: self.model[r][nm] for r in part}, op, self.vars[nm].dtype)
            for r in part:
                self.model[r][nm] = want.copy()

    def do_set_value(self, rng, rank=None) -> None:
        rank = int(rng.integers(self.n)) if rank is None else rank
        names = self.pick_vars(rng)
        arg, text, single = self._arg(names, rng=rng)
        if rng.random() < 0.04 and self._lossy(names, rng) is not None:
            bad = [self._lossy(names, rng)] + [self.model[rank][nm] for nm in names[1:]]
            self._say(f"synk.set_value({rank}, {text}, <a lossy value>)  # TypeError")
            self._expect_error(self._values_refused(TypeError), lambda: synk.set_value(rank, arg, bad[0] if single else bad),
                               "set_value of a value the variable cannot hold")
            return
        passed, held, texts = self._values_arg(names, rng)
        batch = None
        if rng.random() < 0.2 and all(h.ndim for h in held):
            batch = self._random_batch(rng, min(len(h) for h in held))
        self._say(f"synk.set_value({rank}, {text}, " + (texts[0] if single else "[" + ", ".join(texts) + "]")
                  + (f", batch={_show_batch(batch)}" if batch is not None else "") + ")")
        synk.set_value(rank, arg, self._given(passed[0] if single else passed), batch=batch)
        for nm, value in zip(names, held):
            self.set_model(rank, nm, select(value, batch))
        for p in passed:
            _scribble(p)

    def do_get_value(self, rng, rank=None) -> None:
        rank = int(rng.integers(self.n)) if rank is None else rank
        names = self.pick_vars(rng)
        arg, text, single = self._arg(names, rng=rng)
        self._say(f"synk.get_value({rank}, {text})")
        got = synk.get_value(rank, arg)
        self._check_results(f"get_value({rank}, {text})", got, [self.model[rank][nm] for nm in names], single)

    def do_get_shapes(self, rng) -> None:
        names = self.pick_vars(rng)
        arg, text, single = self._arg(names, rng=rng)
        if rng.random() < 0.5:
            self._say(f"synk.get_shapes({text})")
            got = synk.get_shapes(arg)
            wants = [[tuple(s) for s in self.shapes(nm)] for nm in names]
            got_l = [got] if single else list(got)
            if single is False and not isinstance(got, tuple):
                raise ModelMismatch("return", f"get_shapes({text}) returned {type(got).__name__}, not a tuple")
            if [[tuple(s) for s in g] for g in got_l] != wants:
                raise ModelMismatch("return", f"get_shapes({text}): expected {wants}, got {got}")
            return
        self._say(f"synk.get_lengths({text})")
        if any(self.vars[nm].ndim == 0 for nm in names):
            self._expect_error(ValueError, lambda: synk.get_lengths(arg), "get_lengths of a 0-d variable")
            return
        got = synk.get_lengths(arg)
        wants = [np.array([s[0] for s in self.shapes(nm)]) for nm in names]
        self._check_results(f"get_lengths({text})", got, wants, single)

    def do_as_pytensor(self, rng) -> None:
        """Function.as_pytensor: the plain PyTensor function in the master only, on all
        of the inputs; its updates apply to the master's copies."""
        m = self.model[self.master]
        which = str(rng.choice(["f_main", "f_momentum", "f_swap", "f_fast"]))
        if which == "f_main":
            rows = int(rng.choice([1, 2, 7]))
            seed = int(rng.integers(2**31 - 1))
            X = val("float64", (rows, 3), seed, exact=True)
            lr = float(rng.choice(LRS))
            self._say(f"f_main.as_pytensor(val('float64', {(rows, 3)}, {seed}, exact=True), np.array({lr}))")
            got = self.f_main.as_pytensor(X, np.array(lr))
            s0 = X.sum(axis=0)
            wants = [s0 * lr, s0, np.where(X > 0, 2.0, 0.5).prod(axis=0), X.max(axis=0), X.min(axis=0), X * lr,
                     X + 1, s0.astype(np.int64), np.concatenate([s0] * 40)]
            updates = lambda m: {"acc": m["acc"] + X.sum() * lr, "cnt": m["cnt"] + 1}  # noqa: E731
        elif which == "f_momentum":
            self._say("f_momentum.as_pytensor()")
            got = self.f_momentum.as_pytensor()
            wants, updates = [], lambda m: {"prev": m["w"], "w": m["w"] + 1}
        elif which == "f_swap":
            self._say("f_swap.as_pytensor()")
            got = self.f_swap.as_pytensor()
            wants, updates = [m["B"] * np.float32(1)], lambda m: {"B": m["C"], "C": m["B"]}
        else:
            if any(self.model[mm]["w"].shape != self.model[mm]["prev"].shape for mm in self.masters):
                self._say("# f_fast.as_pytensor skipped: w and prev differ in shape")
                return
            self._say("f_fast.as_pytensor()")
            got = self.f_fast.as_pytensor()
            wants = [m["w"] * 1.0]
            updates = lambda m: {"prev": m["w"] * 2.0, "w": m["w"] + m["prev"], "B": m["C"],  # noqa: E731
                                 "C": m["B"] * np.float32(2)}
        if not isinstance(got, list) or len(got) != len(wants):
            raise ModelMismatch("return", f"{which}.as_pytensor(): expected a list of {len(wants)}, got {got!r}"[:500])
        for i, (g, want) in enumerate(zip(got, wants)):
            want = np.asarray(want)
            if not same(want, g):
                raise ModelMismatch("return", f"{which}.as_pytensor() output {i}: {_describe_diff(want, g)}")
        for mm in self.masters:  # (across nodes every node's master runs it on its own copies)
            for nm, value in updates(self.model[mm]).items():
                self.set_model(mm, nm, value)

    def do_misuse(self, rng) -> None:
        """A call the library must refuse at the public edge, changing nothing."""
        X = val("float64", (2 * self.n + 1, 3), int(rng.integers(2**31 - 1)), exact=True)
        lr = np.array(0.5)
        cases = [
            ("f_main(<1-d x>, lr)", TypeError, lambda: self.f_main(X[0], lr)),
            ("f_main(x, lr, batch=[<beyond the rows>])", IndexError, lambda: self.f_main(X, lr, batch=[0, len(X)])),
            ("f_main(x, lr, num_slices=0)", ValueError, lambda: self.f_main(X, lr, num_slices=0)),
            ("f_main(x, lr, output_subset=[99])", IndexError, lambda: self.f_main(X, lr, output_subset=[99])),
            ("f_main(x, lr, nope=1)", TypeError, lambda: self.f_main(X, lr, nope=1)),
            ("f_main(x)", TypeError, lambda: self.f_main(X)),
            ("synk.all_reduce([acc, acc])", ValueError, lambda: synk.all_reduce([self._v("acc"), self._v("acc")])),
            ("synk.gather([B, C, B])", ValueError, lambda: synk.gather([self._v("B"), self._v("C"), self._v("B")])),
            ("synk.broadcast(orphan)  # used by no function", ValueError, lambda: synk.broadcast(self.orphan)),
            ("synk.get_value(0, [acc, orphan])", ValueError, lambda: synk.get_value(0, [self._v("acc"), self.orphan])),
            (f"synk.set_value({self.n}, acc, ...)  # no such rank", ValueError,
             lambda: synk.set_value(self.n, self._v("acc"), np.zeros(3))),
            ("synk.all_reduce(acc, op='mean')", ValueError, lambda: synk.all_reduce(self._v("acc"), op="mean")),
            ("synk.gather(acc, nd_up=2)", ValueError, lambda: synk.gather(self._v("acc"), nd_up=2)),
        ]
        text, exc, call = cases[int(rng.integers(len(cases)))]
        self._say(f"{text}  # {exc.__name__}")
        self._expect_error(exc, call, text)

    def do_master_set(self, rng) -> None:
        """A plain PyTensor set_value on the master's own copy: the master only."""
        names = self.pick_vars(rng)
        nm = names[0]
        value, text = self.new_value(nm, rng)
        borrow = bool(rng.random() < 0.4)
        self._say(f"{nm}.set_value({text}, borrow={borrow})")
        self._v(nm).set_value(value, borrow=borrow)
        for m in self.masters:  # (across nodes every node's master sets its own)
            self.set_model(m, nm, value)
        if not borrow:
            _scribble(value)

    # -- function calls ---------------------------------------------------

    def _rows_of(self, n_rows):
        """Per rank: ``(lo, hi, active)``; the master computes alone on no rows."""
        out = []
        for r in range(self.n):
            lo, hi = split(n_rows, self.n, r)
            out.append((lo, hi, hi > lo or (n_rows == 0 and r == self.master)))
        return out

    @staticmethod
    def _slices(k, num_slices):
        if num_slices == 1 or k <= 1:
            return [(0, k)]
        return [s for s in (split(k, num_slices, j) for j in range(num_slices)) if s[1] > s[0]]

    def _run_rank(self, rows, num_slices, outs_fn, upd_fn, out_ops, upd_names, upd_ops=None):
        """One process's outputs and update values, in slices (the documented accumulation)."""
        slices = self._slices(len(rows), num_slices)
        results = [(outs_fn(rows[a:b]), upd_fn(rows[a:b])) for a, b in slices]
        if len(slices) == 1:
            return results[0]
        weights = [b - a for a, b in slices]
        outs = [_over_slices([res[0][i] for res in results], op, weights) for i, op in enumerate(out_ops)]
        upd_ops = upd_ops or ["avg"] * len(upd_names)
        upds = [cast_into(_over_slices([res[1][j] for res in results], op, weights), self.vars[nm].dtype)
                for j, (nm, op) in enumerate(zip(upd_names, upd_ops))]
        return outs, upds

    def _call_model(self, chosen, num_slices, outs_fn, upd_fn, out_ops, upd_names, failing=()):
        """The model's outputs (None for a process with no rows) of a call on rows ``chosen``,
        its updates applied; ``failing`` ranks raise and apply none."""
        per_rank, weights = [], []
        own = None  # a master without rows: its op-None outputs on its empty share, no updates
        for r, (lo, hi, active) in enumerate(self._rows_of(len(chosen))):
            if not active:
                per_rank.append(None)
                if r == self.master and None in out_ops:
                    own = outs_fn(chosen[lo:hi], r, only={k for k, op in enumerate(out_ops) if op is None})
                continue
            outs, upds = self._run_rank(chosen[lo:hi], num_slices, lambda x, r=r: outs_fn(x, r),
                                        lambda x, r=r: upd_fn(x, r), out_ops, upd_names)
            weights.append((r, float(hi - lo)))
            per_rank.append(outs)
            if r not in failing:
                for nm, u in zip(upd_names, upds):
                    self.set_model(r, nm, u)
        return self._reduced(per_rank, dict(weights), out_ops, own)

    def _reduced(self, per_rank, weights, out_ops, own=None) -> list:
        present = [r for r, o in enumerate(per_rank) if o is not None]
        results = []
        for i, op in enumerate(out_ops):
            if op is None:  # the master's own result (on its empty share when it has no rows)
                mine = per_rank[self.master] if per_rank[self.master] is not None else own
                results.append(None if mine is None else mine[i])
                continue
            parts = [np.asarray(per_rank[r][i]) for r in present]
            if op == "avg":
                parts = [p.astype(np.float64) if p.dtype.kind in "biu" else p for p in parts]
            results.append(combine(parts, op, [weights[r] for r in present]))
        return results

    def _check_outputs(self, what, got, wants, as_list=True) -> None:
        if not as_list:
            self.expect(what, wants[0], got)
            return
        if not isinstance(got, list) or len(got) != len(wants):
            raise ModelMismatch("return", f"{what}: expected a list of {len(wants)} outputs, got "
                                          f"{type(got).__name__} {got if not isinstance(got, list) else len(got)}")
        for i, (g, want) in enumerate(zip(got, wants)):
            if want is None:
                if g is not None:
                    raise ModelMismatch("return", f"{what} output {i}: expected None, "
                                                  f"got {g!r}"[:500])
                continue
            self.expect(f"{what} output {i}", want, g)

    def _x_input(self, rng, cols=None):
        """``(passed, rows as the model sees them, text)`` for a matrix input."""
        if rng.random() < 0.35 and (cols is None or self.data_model["dX"].shape[1] == cols):
            return self.data["dX"], self.data_model["dX"], "dX"
        n = self.n
        rows = int(rng.choice([0, 1, 2, max(n - 1, 0), n, n + 1, 2 * n + 1, 7, 16, 33]))
        cols = int(rng.choice(MAIN_COLS)) if cols is None else cols
        seed = int(rng.integers(2**31 - 1))
        X = val("float64", (rows, cols), seed, exact=True)
        if rng.random() < 0.1:  # cast to the input's dtype, as PyTensor casts (no loss)
            return X.astype(np.int8), X.copy(), f"val('float64', {(rows, cols)}, {seed}, exact=True).astype('int8')"
        return X, X.copy(), f"val('float64', {(rows, cols)}, {seed}, exact=True)"

    def _batch_of(self, rng, length):
        if rng.random() < 0.5:
            return None
        return self._random_batch(rng, length)

    def _habitual_x(self, rng):
        """The inputs of a training loop: the same shapes call after call (the library
        plans such calls), new values."""
        n = self.n
        shape = [(2 * n + 1, 3), (4 * n, 1100), None][int(rng.integers(3))]
        if shape is None:
            return self.data["dX"], self.data_model["dX"], "dX"
        seed = int(rng.integers(2**31 - 1))
        X = val("float64", shape, seed, exact=True)
        return X, X.copy(), f"val('float64', {shape}, {seed}, exact=True)"

    def do_call_main(self, rng) -> None:
        habit = rng.random() < 0.5
        x, X, xtext = self._habitual_x(rng) if habit else self._x_input(rng)
        batch = None if habit else self._batch_of(rng, len(X))
        chosen = select(X, batch)
        num_slices = 1 if habit else int(rng.choice([1, 1, 1, 2, 3, 5]))
        r = rng.random()
        if habit:
            r = 0.5 if r < 0.7 else 0.0
        if r < 0.3:
            lr, lr_v, lr_text = self.data["dlr"], float(self.data_model["dlr"]), "dlr"
        else:
            lr_v = float(rng.choice(LRS))
            lr, lr_text = ((np.array(lr_v), f"np.array({lr_v})") if r < 0.7 else
                           (np.float64(lr_v), f"np.float64({lr_v})") if r < 0.85 else (lr_v, repr(lr_v)))
        ops = ["avg", "sum", "prod", "max", "min", "gather", None, "avg", "avg"]
        subset = None
        if len(chosen) == 0 or (not habit and rng.random() < 0.25):
            allowed = [i for i in range(len(ops)) if len(chosen) or i not in (3, 4)]
            k = int(rng.integers(1, len(allowed) + 1))
            subset = [allowed[i] for i in rng.choice(len(allowed), size=k, replace=False)]
        kw = {}
        if batch is not None:
            kw["batch"] = batch
        if num_slices != 1:
            kw["num_slices"] = num_slices
        if subset is not None:
            kw["output_subset"] = subset
        by_name = not habit and rng.random() < 0.1
        shown = ", ".join(f"{k}={_show_batch(v)}" for k, v in kw.items())
        self._say(f"f_main({'x=' if by_name else ''}{xtext}, {'lr=' if by_name else ''}{lr_text}"
                  + (", " + shown if shown else "") + ")")
        got = self.f_main(x=x, lr=lr, **kw) if by_name else self.f_main(x, lr, **kw)

        def outs(xs, r, only=None):
            s0 = xs.sum(axis=0)
            full = [lambda: s0 * lr_v, lambda: s0.copy(), lambda: np.where(xs > 0, 2.0, 0.5).prod(axis=0),
                    lambda: xs.max(axis=0), lambda: xs.min(axis=0), lambda: xs * lr_v, lambda: xs + 1,
                    lambda: s0.astype(np.int64), lambda: np.concatenate([s0] * 40)]
            return [full[i]() if only is None or k in only else None for k, i in enumerate(chosen_outs)]

        def upds(xs, r):
            return [self.model[r]["acc"] + xs.sum() * lr_v, self.model[r]["cnt"] + 1]
        chosen_outs = list(range(len(ops))) if subset is None else subset
        wants = self._call_model(chosen, num_slices, outs, upds, [ops[i] for i in chosen_outs], ["acc", "cnt"])
        self._check_outputs("f_main", got, wants)
        if isinstance(x, np.ndarray):
            _scribble(x)
        if isinstance(lr, np.ndarray):
            _scribble(lr)

    def do_call_bc(self, rng) -> None:
        habit = rng.random() < 0.5
        x, X, xtext = self._habitual_x(rng) if habit else self._x_input(rng)
        cols = X.shape[1]
        if self.data_model["dY"].shape == (cols,) and rng.random() < 0.4:
            y, y_v, ytext = self.data["dY"], self.data_model["dY"], "dY"
        else:
            seed = int(rng.integers(2**31 - 1))
            y_v = val("float64", (cols,), seed, exact=True)
            y, ytext = y_v.copy(), f"val('float64', ({cols},), {seed}, exact=True)"
        if rng.random() < 0.3:
            k, k_v, ktext = self.data["dK"], int(self.data_model["dK"]), "dK"
        else:
            k_v = int(rng.integers(-3, 4))
            k, ktext = (np.array(k_v), f"np.array({k_v})") if rng.random() < 0.6 else (k_v, repr(k_v))
        batch = None if habit else self._batch_of(rng, len(X))
        chosen = select(X, batch)
        num_slices = 1 if habit else int(rng.choice([1, 1, 2, 3]))
        self._say(f"f_bc({xtext}, {ytext}, {ktext}"
                  + (f", batch={_show_batch(batch)}" if batch is not None else "")
                  + (f", num_slices={num_slices}" if num_slices != 1 else "") + ")")
        got = self.f_bc(x, y, k, batch=batch, num_slices=num_slices)
        wants = self._call_model(chosen, num_slices, lambda xs, r: [xs.dot(y_v) * k_v, y_v * k_v, xs.sum(axis=0) * k_v],
                                 lambda xs, r: [], ["gather", "max", "sum"], [])
        self._check_outputs("f_bc", got, wants)
        for a in (x, y, k):
            if isinstance(a, np.ndarray):
                _scribble(a)

    def _call_no_inputs(self, fn, text, outs, upd, out_ops, upd_names, as_list=True, **kw) -> None:
        """A call without scattered inputs: every process computes all of it."""
        self._say(f"{text}()")
        got = fn(**kw)
        per_rank = []
        for r in range(self.n):
            o, u = outs(r), upd(r)
            per_rank.append(o)
            for nm, value in zip(upd_names, u):
                self.set_model(r, nm, value)
        wants = self._reduced(per_rank, {r: 1.0 for r in range(self.n)}, out_ops)
        self._check_outputs(text, got, wants, as_list)

    def do_call_swap(self, rng) -> None:
        m = self.model
        self._call_no_inputs(self.f_swap, "f_swap", lambda r: [m[r]["B"] * np.float32(1)],
                             lambda r: [m[r]["C"], m[r]["B"]], ["gather"], ["B", "C"])

    def do_call_momentum(self, rng) -> None:
        m = self.model
        self._call_no_inputs(self.f_momentum, "f_momentum", lambda r: [],
                             lambda r: [m[r]["w"], m[r]["w"] + 1], [], ["prev", "w"])

    def _repair(self, names, rng) -> None:
        """Give ``names`` values of their usual shape everywhere (a broadcast of new
        values, logged like any step), so that the function needing it can run."""
        values = [val(self.vars[nm].dtype, (USUAL[nm],), int(rng.integers(2**31 - 1))) for nm in names]
        self._say(f"synk.broadcast([{', '.join(names)}], [" + ", ".join(_show(v) for v in values) + "])"
                  "  # usual shapes, for the next call")
        synk.broadcast([self._v(nm) for nm in names], values)
        for nm, value in zip(names, values):
            for r in range(self.n):
                self.set_model(r, nm, value)

    def _same_shapes(self, rng, a, b) -> None:
        """Repair ``a`` and ``b`` (drawing from ``rng`` once either way) where a rank holds them in different shapes."""
        repair = np.random.default_rng(int(rng.integers(2**63 - 1)))
        if any(self.model[r][a].shape != self.model[r][b].shape for r in range(self.n)):
            self._repair([a, b], repair)

    def do_call_fast(self, rng) -> None:
        m = self.model
        self._same_shapes(rng, "prev", "w")
        self._call_no_inputs(self.f_fast, "f_fast", lambda r: [m[r]["w"] * 1.0],
                             lambda r: [m[r]["w"] * 2.0, m[r]["w"] + m[r]["prev"], m[r]["C"],
                                        m[r]["B"] * np.float32(2)], ["gather"], ["prev", "w", "B", "C"])

    def do_call_givens(self, rng) -> None:
        m = self.model
        self._same_shapes(rng, "G", "H")
        self._call_no_inputs(self.f_givens, "f_givens", lambda r: [m[r]["H"] * 2.0],
                             lambda r: [m[r]["G"] + m[r]["H"] * 2.0], ["gather"], ["G"])

    def do_call_scale(self, rng) -> None:
        m = self.model
        holders = ["Zi", "Zb", "Z0", "Zi0", "Ze"]

        def outs(r):
            got = [np.int64(m[r]["Z64"].shape[0])]
            for h in holders:
                value = m[r][h]
                got.append(np.int64(value.shape[0]) if value.ndim else value * np.asarray(1, value.dtype))
            return got
        self._call_no_inputs(self.f_scale, "f_scale", outs,
                             lambda r: [m[r]["Z64"] * 2.0, m[r]["Z32"] + np.float32(1)],
                             ["sum"] + ["max"] * len(holders), ["Z64", "Z32"])

    def do_call_tiny(self, rng) -> None:
        if not self.with_tiny:
            self._say("# f_tiny skipped: no tiny variables")
            return
        m = self.model
        names = [f"t{i}" for i in range(300)]
        self._call_no_inputs(self.f_tiny, "f_tiny", lambda r: [m[r]["t0"] * 1.0],
                             lambda r: [m[r][nm] + np.asarray(1, m[r][nm].dtype) for nm in names],
                             ["gather"], names)

    def do_call_late(self, rng) -> None:
        if not self.late:
            self._say("# f_late skipped: none built yet")
            return
        vname, fname = self.late[int(rng.integers(len(self.late)))]
        self._late_call(vname, fname)

    def _late_call(self, vname, fname) -> None:
        m = self.model
        dtype = self.vars[vname].dtype
        self._call_no_inputs(self.late_fns[fname], fname, lambda r: [m[r][vname] * np.asarray(1, dtype)],
                             lambda r: [m[r][vname] + m[r]["cnt"].astype(dtype)], ["gather"], [vname])

    def do_call_sliced(self, rng) -> None:
        m, n = self.model, self.n
        repair = np.random.default_rng(int(rng.integers(2**63 - 1)))
        if any(m[r]["T"].shape != (2,) for r in range(n)):
            self._repair(["T"], repair)
        if min(m[r]["S"].shape[0] for r in range(n)) == 0:  # rows in every process
            rows, seed = 2 * n + 1, int(repair.integers(2**31 - 1))
            value = val("float64", (rows, 2), seed, exact=True)
            self._say(f"synk.scatter(S, val('float64', {(rows, 2)}, {seed}, exact=True))  # rows for the next call")
            synk.scatter(self._v("S"), value)
            for r in range(n):
                lo, hi = split(rows, n, r)
                self.set_model(r, "S", value[lo:hi])
        lengths = [m[r]["S"].shape[0] for r in range(n)]
        form = rng.random()
        habit = rng.random() < 0.4  # a loop's call: every row, no options (the library plans it)
        if habit or form < 0.2:
            batch_s, per_rank = None, [np.arange(L) for L in lengths]
        elif form < 0.45:
            a = int(rng.integers(0, min(lengths)))
            b = int(rng.integers(a + 1, min(lengths) + 1))
            batch_s = slice(a, b)
            per_rank = [np.arange(a, b)] * n
        elif form < 0.65:
            batch_s = rng.integers(0, min(lengths), size=int(rng.integers(1, 6)))
            per_rank = [batch_s] * n
        else:
            batch_s, per_rank = [], []
            for L in lengths:
                if rng.random() < 0.5:
                    a = int(rng.integers(0, L))
                    b = int(rng.integers(a + 1, L + 1))
                    batch_s.append(slice(a, b))
                    per_rank.append(np.arange(a, b))
                else:
                    idx = rng.integers(-L, L, size=int(rng.integers(1, 6)))
                    batch_s.append(idx)
                    per_rank.append(np.where(idx < 0, idx + L, idx))
        num_slices = int(rng.choice([1, 1, 2, 3]))
        if habit:
            num_slices = 1
        self._say(f"f_sliced(batch_s={_show_batch(batch_s)}"
                  + (f", num_slices={num_slices}" if num_slices != 1 else "") + ")")
        got = self.f_sliced(batch_s=self._own_batch_s(batch_s), num_slices=num_slices)
        out_ops = ["sum", "avg"]
        outs_all, weights = [], {}
        for r in range(n):
            rows = m[r]["S"][per_rank[r]]
            outs, upds = self._run_rank(rows, num_slices, lambda s: [s.sum(axis=0), s.sum(axis=0)],
                                        lambda s, r=r: [m[r]["T"] + s.sum(axis=0)], out_ops, ["T"], ["max"])
            outs_all.append(outs)
            weights[r] = float(len(rows))
            self.set_model(r, "T", upds[0])
        self._check_outputs("f_sliced", got, self._reduced(outs_all, weights, out_ops))

    def do_call_fail(self, rng) -> None:
        """A call whose graph raises in some processes only: a marked row in the rows of
        some ranks (across nodes every node passes the same rows: a marked row fails the
        process of every node that holds it)."""
        n = self.n
        rows = int(rng.choice([n, n + 1, 2 * n, 3 * n + 1]))
        seed = int(rng.integers(2**31 - 1))
        X = val("float64", (rows, 2), seed, exact=True)
        spans = self._rows_of(rows)
        marked = []
        for r in [r for r in range(n) if rng.random() < self._fail_chance()]:
            lo, hi, _ = spans[r]
            marked.append(int(rng.integers(lo, hi)))
            X[marked[-1], int(rng.integers(2))] = FAIL_MARK
        failing = [r for r, (lo, hi, _) in enumerate(spans) if any(lo <= i < hi for i in marked)]
        num_slices = int(rng.choice([1, 1, 2, 3]))
        self._say(f"f_fail(val('float64', ({rows}, 2), {seed}, exact=True) with {FAIL_MARK} in the rows of "
                  f"ranks {failing}" + (f", num_slices={num_slices}" if num_slices != 1 else "") + ")"
                  + ("  # AssertionError" if failing else ""))
        m = self.model
        wants = self._call_model(X.copy(), num_slices, lambda xs, r: [xs.sum(axis=0)],
                                 lambda xs, r: [m[r]["acc"] + xs.sum(), m[r]["cnt"] + 1],
                                 ["sum"], ["acc", "cnt"], failing=set(failing))
        if failing:
            self._expect_error(self._failed_call_raises(failing), lambda: self.f_fail(X, num_slices=num_slices),
                               f"f_fail failing in ranks {failing}")
            return
        got = self.f_fail(X, num_slices=num_slices)
        self._check_outputs("f_fail", got, wants)

    def _fail_chance(self) -> float:
        """How likely each rank is to get a marked row in ``do_call_fail``."""
        return 0.35

    def _failed_call_raises(self, failing):
        """What a call whose graph raised in ranks ``failing`` raises here."""
        return AssertionError

    # -- synk.data -------------------------------------------------------

    def do_data_resize(self, rng) -> None:
        name = str(rng.choice(["dX", "dX", "dlr", "dY", "dK"]))
        d = self.data[name]
        seed = int(rng.integers(2**31 - 1))
        if name == "dX":
            shape = (int(rng.choice([0, 1, 2, self.n, 2 * self.n + 1, 9, 30, 100])), int(rng.choice(MAIN_COLS)))
            value, text = val("float64", shape, seed, exact=True), f"val('float64', {shape}, {seed}, exact=True)"
        elif name == "dY":
            shape = (int(rng.choice(MAIN_COLS)),)
            value, text = val("float64", shape, seed, exact=True), f"val('float64', {shape}, {seed}, exact=True)"
        elif name == "dlr":
            value = np.array(float(rng.choice(LRS)))
            text = f"np.array({float(value)})"
        else:
            value = np.array(int(rng.integers(-3, 4)), "int64")
            text = f"np.array({int(value)})"
        if name == "dX" and rng.random() < 0.3:
            cur = self.data_model[name]
            if rng.random() < 0.25:  # documented: empty, of shape (0, 0)
                self._say(f"{name}.free_memory()")
                d.free_memory()
                self.data_model[name] = np.zeros((0, 0))
                return
            k = int(rng.integers(0, len(cur) + 1))  # shorter: the rows that remain are kept
            self._say(f"{name}.set_length({k})")
            d.set_length(k)
            self.data_model[name] = cur[:k].copy()
            return
        self._say(f"{name}.set_value({text})")
        d.set_value(value)
        self.data_model[name] = value.copy()
        _scribble(value)

    def do_data_write(self, rng) -> None:
        """Rewrite a synk.data in place (the workers read it in place at the next call)."""
        name = str(rng.choice(["dX", "dX", "dlr", "dY", "dK"]))
        d, cur = self.data[name], self.data_model[name]
        seed = int(rng.integers(2**31 - 1))
        if cur.ndim == 0:
            value = np.array(float(rng.choice(LRS)) if name == "dlr" else int(rng.integers(-3, 4)), cur.dtype)
            self._say(f"{name}.data[...] = {value.item()!r}")
            d.data[...] = value
            cur[...] = value
            return
        if len(cur) and rng.random() < 0.5:
            i = int(rng.integers(len(cur)))
            row = val("float64", cur.shape[1:], seed, exact=True)
            self._say(f"{name}[{i}] = val('float64', {cur.shape[1:]}, {seed}, exact=True)")
            d[i] = row
            cur[i] = row
            return
        value = val("float64", cur.shape, seed, exact=True)
        self._say(f"{name}.data[...] = val('float64', {cur.shape}, {seed}, exact=True)")
        d.data[...] = value
        cur[...] = value

    # -- new variables and functions after distribute(); a new fork -------

    def do_new_fn(self, rng) -> None:
        if len(self.late) >= MAX_LATE:
            self._say("# new_fn skipped: enough late functions")
            return
        k = len(self.late)
        dtype = str(rng.choice(["float64", "float32", "int64"]))
        shape = (int(rng.integers(0, 5)),) if rng.random() < 0.6 else (int(rng.integers(0, 4)), 2)
        seed = int(rng.integers(2**31 - 1))
        vname, fname = f"L{k}", f"f_late{k}"
        self._add_var(vname, val(dtype, shape, seed), group="late")
        self.late.append((vname, fname))
        self._say(f"{vname} = pytensor.shared(val({dtype!r}, {shape}, {seed}), name={vname!r}); "
                  f"{fname} = synk.function([], [({vname} * 1, 'gather')], updates=[({vname}, {vname} + cnt)])")
        self.late_fns[fname] = self._late_function(vname, fname)
        if rng.random() < 0.5:  # before it reaches the workers: the master's value goes
            value, text = self.new_value(vname, rng)
            self._say(f"{vname}.set_value({text})")
            self._v(vname).set_value(value)
            for r in range(self.n):
                self.set_model(r, vname, value)
        first = rng.random()
        if first < 0.5:  # distributed by its first call
            self._late_call(vname, fname)
        elif first < 0.7:  # or by distribute(); else by the next collective (the check's get_value)
            self._say("synk.distribute()")
            synk.distribute()

    def do_make_tiny(self, rng) -> None:
        """300 tiny variables (more than the 16 a worker publishes, more than the 256
        home slots) and one function that updates them all, after distribute()."""
        if self.with_tiny:
            self._say("# make_tiny skipped: made already")
            return
        for i in range(300):
            kind = i % 3
            value = (np.array([float(i)]) if kind == 0 else np.array([i, -i], "int32") if kind == 1
                     else np.asarray(np.float32(i / 2)))
            self._add_var(f"t{i}", value, group="tiny")
        self.with_tiny = True
        self._say("t0 ... t299 = <300 tiny shared variables>; f_tiny = synk.function([], [(t0 * 1, 'gather')], "
                  "updates=[(t, t + 1) for each])")
        self._tiny_function()
        first = rng.random()
        if first < 0.4:  # distributed by its first call
            self.do_call_tiny(rng)
        elif first < 0.7:  # or by a collective on the new variables
            k = int(rng.choice([17, 300]))
            self.do_all_reduce(rng, [f"t{i}" for i in rng.choice(300, size=k, replace=False)])

    def do_refork(self, rng) -> None:
        """close() and fork again: functions and synk.data are built anew; every process
        starts from the master's values (close() leaves them in the variables)."""
        old_fn, old_data = self.f_swap, self.data["dX"]
        self._say(f"synk.close(); synk.fork({self.n}, master_rank={self.master}); "
                  "<every function and synk.data built again>; "
                  "synk.distribute()")
        self.close()
        self.fork_fn(self.n, master_rank=self.master)
        self._expect_error(synk.SynkError, old_fn, "a function of the closed fork")
        self._expect_error(RuntimeError, lambda: old_data.data, "a synk.data of the closed fork")
        for r in range(self.n):
            for nm in self.vars:
                self.model[r][nm] = self.model[self.master_of(r)][nm].copy()
        self._build_functions()
        self._make_data()
        synk.distribute()


# ---------------------------------------------------------------------------
# running and minimising


@dataclasses.dataclass
class Failure:
    index: int            # of the failing step
    step: Step
    category: str
    message: str
    log: list             # the log lines of every step up to the failing one, per step
    tb: str = ""

    @property
    def signature(self) -> tuple:
        return (self.step.kind, self.category)


def run_steps(n: int, steps: list, fork_fn, master: int = 0, deadline=None, make=None) -> Failure | None:
    """Run ``steps`` on a fresh fork of ``n`` processes, checking after every one;
    the first failure, or None (also when ``deadline`` passes). Closes the fork.
    ``make()``: the world instead of ``World(n, fork_fn, master)`` (across nodes)."""
    world = None
    per_step: list = []
    try:
        world = World(n, fork_fn, master) if make is None else make()
        world.check_state()
        for i, step in enumerate(steps):
            if deadline is not None and time.monotonic() > deadline:
                return None
            if step.gap_ms:
                time.sleep(step.gap_ms / 1000)
            start = len(world.log)
            try:
                world.apply(step)
                world.check_state()
            except Exception as err:
                per_step.append((step, world.log[start:]))
                category = err.category if isinstance(err, ModelMismatch) else f"exception:{type(err).__name__}"
                return Failure(i, step, category, f"{type(err).__name__}: {err}", per_step,
                               traceback.format_exc())
            per_step.append((step, world.log[start:]))
        return None
    finally:
        if world is not None:
            world.close()
        synk.close()


def minimise(n: int, steps: list, failure: Failure, fork_fn, master: int = 0, budget_s: float = 240.0) -> tuple:
    """Delta debugging: the shortest subsequence of ``steps`` found within
    ``budget_s`` seconds that fails the same way (the same kind of step, the
    same category of failure): chunks first, then single steps. Returns
    ``(steps, failure, replays)``."""
    deadline = time.monotonic() + budget_s
    want = failure.signature
    best, best_failure = list(steps[: failure.index + 1]), failure
    replays = 0

    def fails(candidate):
        nonlocal replays
        replays += 1
        got = run_steps(n, candidate, fork_fn, master)
        return got if got is not None and got.signature == want else None

    # the short ends first, each tried three times (a failure that depends on timing
    # may not come every time): the failing step alone, then the last few
    for tail in (1, 3, 8):
        if tail >= len(best):
            break
        got = next((g for g in (fails(best[-tail:]) for _ in range(3)) if g is not None), None)
        if got is not None:
            best, best_failure = best[-tail:][: got.index + 1], got
            break
    chunks = 2
    while len(best) > 1 and time.monotonic() < deadline:
        size = max(1, len(best) // chunks)
        reduced = False
        start = 0
        while start < len(best) and time.monotonic() < deadline:
            candidate = best[:start] + best[start + size:]
            got = fails(candidate) if candidate else None
            if got is not None:
                best, best_failure, reduced = candidate[: got.index + 1], got, True
            else:
                start += size
        if reduced:
            chunks = max(2, chunks - 1)
        elif size == 1:
            break
        else:
            chunks = min(len(best), chunks * 2)
    return best, best_failure, replays


def report(seed: int, n: int, master: int, total: int, steps: list, failure: Failure, note: str = "") -> str:
    """The failure as text: the seed, the sequence as Python-ish lines, what differed."""
    lines = [f"model test failed: seed={seed}, n_parallel={n}, master_rank={master}: "
             f"a failing sequence of {len(steps)} steps "
             f"(from a random run of {total}){note}",
             f"  replay: model_lib.run_steps({n}, [{', '.join(repr(s) for s in steps)}], fork, master={master})",
             "  the synkhronos calls of each step (values: model_lib.val(dtype, shape, seed)):",
             f"    synk.fork({n}, master_rank={master}); "
             "<tests/model_lib.py World: its variables, functions and synk.data>; "
             "synk.distribute()"]
    for step, log in failure.log:
        lines.append(f"    # {step!r}")
        for line in log or ["# (no call)"]:
            lines.append(f"    {line}")
    lines.append(f"  failed at the last step ({failure.category}): {failure.message}")
    if failure.category.startswith("exception"):
        lines.append("  traceback:\n    " + failure.tb.strip().replace("\n", "\n    ")[-4000:])
    return "\n".join(lines)
