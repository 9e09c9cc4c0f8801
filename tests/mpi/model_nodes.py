"""The model-based random test (tests/model_lib.py) across nodes, under ``mpirun``.

Usage: ``mpirun -np N python model_nodes.py OUT SIZES MASTERS SEED STEPS``. Node k
forks ``SIZES[k]`` processes with ``master_rank=MASTERS[k]`` (comma lists, one entry
per node). Every node master draws the same random steps (``model_lib.random_steps``)
and makes the same calls, as an SPMD script does; each keeps the same model of every
process of every node (global ranks) and checks after every step every rank's copy of
every variable (``get_value`` with global ranks), its own master's copies and every
returned value, bit for bit, as ``tests/test_model.py`` does on one node.

What differs from one node (:class:`NodeWorld`, as docs/nodes.rst defines it): each
node's inputs are split among its own processes, every node passing the same inputs;
reductions are hierarchical (each node's processes combined in rank order, then the
nodes in node order, an ``avg`` weighted by each node's total); a collective that
takes values uses node 0's (a ``broadcast`` without values, node 0's master's copies);
``reduce(in_place=True)`` and a plain ``set_value`` reach every node's master; a call on
no rows anywhere raises ``ValueError`` on every node; a per-process ``batch_s`` list has
one entry per process of the node; after ``close()`` and ``fork()`` each node's
processes start from their own master's values; ``as_pytensor`` runs in every node's
master on its own copies. A ``join`` step (:meth:`NodeWorld.do_join`): some nodes call
``synk.join()``, the others make a few calls and collectives without them (no rows, their
variables left out, ValueError where a collective needs them), then join too.

Each node writes ``verdict.<node>.json``: ok, the steps run, and on a failure the
report of ``model_lib.report`` (the seed, the steps, what differed).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: model_lib and conftest's MODE

from common import Verdict  # noqa: E402  (puts this checkout's synkhronos first)

import synkhronos as synk  # noqa: E402
from model_lib import (_UFUNCS, KINDS, ModelMismatch, Step, World, combine, random_steps,  # noqa: E402
                       report, run_steps, select)
from synkhronos._batching import split  # noqa: E402
from synkhronos.errors import PeerFailed  # noqa: E402


#: The steps the nodes that have not joined make while others have (see NodeWorld.do_join).
JOINED_KINDS = ["call_main", "call_main", "call_bc", "all_reduce", "all_reduce", "reduce", "gather",
                "all_gather", "broadcast", "scatter", "set_value", "get_value", "get_shapes"]
#: How often a join step is drawn across nodes (beside model_lib.KINDS' weights).
JOIN_WEIGHT = 3


class _NoRows(Exception):
    """A call on no rows on any node was refused on every node, as documented (the step ends)."""


class _RowsGuard:
    """A function whose first input holds the rows (``f_main``, ``f_bc``). A plain array of
    an odd number of rows without ``batch``: node k passes it without its first k rows
    (nodes with fewer rows, or none, than the others); every other input alike on every
    node. A call on no rows on any node must raise ``ValueError`` on every node where it
    has reduced outputs (``ops``: each output's op); with op-None outputs only, each node
    master returns its result on no rows."""

    def __init__(self, world: NodeWorld, fn, ops):
        self._world, self._fn, self._ops = world, fn, ops

    def __getattr__(self, name):
        return getattr(self._fn, name)

    def __call__(self, *args, **kwargs):
        world = self._world
        x = kwargs.get("x", args[0] if args else None)
        try:
            rows = world.data_model["dX"] if x is world.data["dX"] else np.asarray(x)
            count = len(select(rows, kwargs.get("batch")))
        except Exception:  # noqa: BLE001 - a call the library refuses anyway: it goes through
            count = None
        if type(x) is np.ndarray and x.ndim == 2 and len(x) % 2 == 1 and kwargs.get("batch") is None:
            world.dropped = [min(k, len(x)) for k in range(len(world.sizes))]
            world._say(f"  # node k passes its input without its first k rows: {world.dropped}")
            mine = x[world.dropped[world.node]:]
            args, kwargs = ((mine,) + tuple(args[1:]), kwargs) if args else (args, dict(kwargs, x=mine))
        subset = kwargs.get("output_subset")
        reduced = any(self._ops[i] is not None for i in (range(len(self._ops)) if subset is None else subset))
        if count is not None and world.joined:  # (rows on the nodes taking part only)
            count = sum(max(count - world.dropped[k], 0) for k in range(len(world.sizes)) if k not in world.joined)
        if count == 0 and reduced:
            world._expect_error(ValueError, lambda: self._fn(*args, **kwargs), "a call on no rows on any node")
            world._say("  # ValueError on every node: no node passed any rows")
            raise _NoRows()
        return self._fn(*args, **kwargs)


class NodeWorld(World):
    """The model of every process of every node; this node master's view of it."""

    def __init__(self, sizes, node: int, masters):
        self.sizes, self.node, self.local_masters = list(sizes), node, list(masters)
        self.prefixes: list = []  # each fork's names in /dev/shm
        self.dropped = [0] * len(sizes)  # rows each node leaves out of this step's call (_RowsGuard)
        self.joined: set = set()  # the nodes that have joined (synk.join()), during a join step
        self._others_given = 0  # (_given: None every other time)
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        super().__init__(sum(sizes), self._fork, self.offsets[node] + masters[node])
        self.root = self.offsets[0] + masters[0]
        self.masters = [o + m for o, m in zip(self.offsets, masters)]

    def _fork(self, n, master_rank) -> None:
        synk.fork(self.sizes[self.node], device="cpu", master_rank=self.local_masters[self.node])
        self.prefixes.append(synk._state.current().proc.prefix)

    def _nodes(self) -> list:
        """Per node, its processes' global ranks."""
        return [list(range(o, o + s)) for o, s in zip(self.offsets, self.sizes)]

    def node_of(self, rank: int) -> int:
        return next(k for k, ranks in enumerate(self._nodes()) if rank in ranks)

    def master_of(self, rank: int) -> int:
        return self.masters[self.node_of(rank)]

    def taking_part(self) -> list:
        return [r for k, ranks in enumerate(self._nodes()) if k not in self.joined for r in ranks]

    # -- synk.join() -------------------------------------------------------

    def do_join(self, rng) -> None:
        """Some nodes join (``synk.join()``); the others make 0-3 steps of the kinds that
        JOINED_KINDS lists, then join too. Meanwhile the joined nodes' processes have no
        rows and their variables take no part (docs/nodes.rst): each step's model leaves
        them out, and the steps that cannot leave them out raise ValueError on every node
        taking part. Then every node's join() returns the same node (the smallest of those
        that joined at the last exchange), and the joined nodes take the others' model
        (through mpi4py's COMM_WORLD, the test's own channel: the model is the test's), with
        their own values unchanged."""
        k = len(self.sizes)
        if k < 2:
            return
        first = sorted(int(i) for i in rng.choice(k, size=int(rng.integers(1, k)), replace=False))
        rest = [i for i in range(k) if i not in first]
        pool = [kd for kd in JOINED_KINDS if kd != "all_gather" or 0 not in first]  # (its _cap_growth broadcasts)
        kinds = [str(rng.choice(pool)) for _ in range(int(rng.integers(0, 4)))]
        seeds = [int(x) for x in rng.integers(0, 2**31 - 1, size=len(kinds))]
        self._say(f"# nodes {first} join; then nodes {rest} make {kinds} and join")
        if self.node not in first:
            self.joined = set(first)
            try:
                for kind, seed in zip(kinds, seeds):
                    self.apply(Step(kind, seed))
                    self.check_state()
            finally:
                self.joined = set()
        last = synk.join()
        self._say(f"synk.join()  # returned {last}")
        from mpi4py import MPI  # (initialised by synk.fork under mpirun)

        lasts = MPI.COMM_WORLD.allgather(last)
        # the node that joined last, the smallest of those that joined at the same exchange:
        # the first of the others, or (no exchange between, as without steps) node 0
        expected = {0, rest[0]} if kinds else {0}
        if len(set(lasts)) != 1 or lasts[0] not in expected:
            raise ModelMismatch("return", f"join() returned {lasts} on the nodes; expected the same "
                                          f"node of {sorted(expected)} everywhere")
        self.model = MPI.COMM_WORLD.bcast(self.model if self.node == rest[0] else None, root=rest[0])

    def do_broadcast(self, rng) -> None:
        if 0 not in self.joined:
            return super().do_broadcast(rng)
        names = self.pick_vars(rng)
        self._say(f"synk.broadcast([{', '.join(names)}])  # ValueError: node 0 has joined")
        self._expect_error(ValueError, lambda: synk.broadcast([self._v(nm) for nm in names]),
                           "broadcast while node 0 has joined")

    def do_scatter(self, rng) -> None:
        if not self.joined:
            return super().do_scatter(rng)
        names = self.pick_vars(rng, need_ndim=1)
        values = [np.concatenate([self.model[r][nm] for r in range(self.n)]) for nm in names]
        self._say(f"synk.scatter([{', '.join(names)}], <values>)  # ValueError: nodes have joined")
        self._expect_error(ValueError, lambda: synk.scatter([self._v(nm) for nm in names], values),
                           f"scatter while nodes {sorted(self.joined)} have joined")

    def do_set_value(self, rng, rank=None) -> None:
        if not self.joined:
            return super().do_set_value(rng)
        rank = int(rng.integers(self.n))
        if 0 not in self.joined and self.node_of(rank) not in self.joined:
            return super().do_set_value(rng, rank)
        nm = self.pick_vars(rng)[0]
        self._say(f"synk.set_value({rank}, {nm}, <its value>)  # ValueError: a joined node")
        self._expect_error(ValueError, lambda: synk.set_value(rank, self._v(nm), self.model[self.master][nm]),
                           f"set_value of rank {rank} while nodes {sorted(self.joined)} have joined")

    def do_get_value(self, rng, rank=None) -> None:
        if not self.joined:
            return super().do_get_value(rng)
        rank = int(rng.integers(self.n))
        if self.node_of(rank) not in self.joined:
            return super().do_get_value(rng, rank)
        nm = self.pick_vars(rng)[0]
        self._say(f"synk.get_value({rank}, {nm})  # ValueError: its node has joined")
        self._expect_error(ValueError, lambda: synk.get_value(rank, self._v(nm)),
                           f"get_value of rank {rank} while nodes {sorted(self.joined)} have joined")

    def _build_functions(self) -> None:
        super()._build_functions()
        self.f_main = _RowsGuard(self, self.f_main, ["avg", "sum", "prod", "max", "min", "gather", None, "avg", "avg"])
        self.f_bc = _RowsGuard(self, self.f_bc, ["gather", "max", "c_sum"])

    def apply(self, step) -> None:
        self.dropped = [0] * len(self.sizes)  # rows each node leaves out of this step's call (_RowsGuard)
        try:
            super().apply(step)
        except _NoRows:
            pass

    def _rows_of(self, n_rows):
        """Per global rank: its rows of its node's inputs (``n_rows`` without the first
        ``dropped[k]`` on node k, split among the node's processes), and whether it has
        any: a process without rows adds nothing and applies no updates, a node without
        rows too (no rows on any node raised already, _RowsGuard)."""
        out = []
        for k, ranks in enumerate(self._nodes()):
            d = self.dropped[k]
            if k in self.joined:  # (a node that has joined: no rows, no updates)
                out += [(0, 0, False)] * len(ranks)
                continue
            for j in range(len(ranks)):
                lo, hi = split(n_rows - d, self.sizes[k], j)
                out.append((lo + d, hi + d, hi > lo))
        return out

    def _reduced(self, per_rank, weights, out_ops, own=None) -> list:
        """Each node's present processes combined in rank order, then the nodes in node
        order, an avg weighted by each node's total weight (docs/nodes.rst)."""
        results = []
        for i, op in enumerate(out_ops):
            if op is None:  # this node master's own result
                mine = per_rank[self.master] if per_rank[self.master] is not None else own
                results.append(None if mine is None else mine[i])
                continue
            parts, node_weights = [], []
            for ranks in self._nodes():
                present = [r for r in ranks if per_rank[r] is not None]
                if not present:
                    continue
                mine = [np.asarray(per_rank[r][i]) for r in present]
                if op == "avg":
                    mine = [p.astype(np.float64) if p.dtype.kind in "biu" else p for p in mine]
                parts.append(combine(mine, op, [weights[r] for r in present]))
                node_weights.append(sum(weights[r] for r in present))
            results.append(combine(parts, op, node_weights))
        return results

    def _reduce_collective(self, parts: dict, op: str, dtype) -> np.ndarray:
        """Hierarchical: each node's processes in rank order, then the nodes taking part;
        an avg is each node's average weighted by its process count, rounded into integers once."""
        dtype = np.dtype(dtype)
        groups = [[np.asarray(parts[r]) for r in ranks] for ranks in self._nodes() if ranks[0] in parts]
        if op != "avg":
            folded = [functools.reduce(_UFUNCS[op], g) for g in groups]
            return np.asarray(functools.reduce(_UFUNCS[op], folded)).astype(dtype)
        work = dtype if dtype.kind == "f" else np.dtype(np.float64)
        means = [combine([p.astype(work) for p in g], "avg") for g in groups]
        mean = np.asarray(combine(means, "avg", [len(g) for g in groups]))
        if dtype.kind != "f":
            mean = mean.round()
        return mean.astype(dtype)

    def _shapes_refused(self, names):
        """ValueError where this node's own processes hold different shapes, or where only
        the nodes differ; PeerFailed where another node's processes differ and this node's not."""
        def differs(ranks):
            return any(len({self.model[r][nm].shape for r in ranks}) > 1 for nm in names)
        nodes = [ranks if k not in self.joined else [] for k, ranks in enumerate(self._nodes())]
        if differs(nodes[self.node]) or not any(differs(ranks) for ranks in nodes):
            return ValueError
        return PeerFailed

    def _given(self, values):
        """Node 0's values count; every other node passes None every other time, else its
        values negated (ignored all the same, docs/nodes.rst)."""
        if self.node == 0:
            return values
        self._others_given += 1
        if self._others_given % 2:
            return None
        if isinstance(values, (list, tuple)):
            return [self._given_one(v) for v in values]
        return self._given_one(values)

    @staticmethod
    def _given_one(value):
        a = np.asarray(getattr(value, "data", value))
        return -a if a.dtype.kind in "fi" else a

    def _values_refused(self, exc_type):
        return exc_type if self.node == 0 else PeerFailed

    def _own_batch_s(self, batch_s):
        if isinstance(batch_s, list):  # one entry per process: this node's
            o = self.offsets[self.node]
            return batch_s[o:o + self.sizes[self.node]]
        return batch_s

    def _fail_chance(self) -> float:
        return 0.35 / len(self.sizes)  # (each marked row fails a process on every node)

    def _failed_call_raises(self, failing):
        """A node whose own processes all ran hears of the others' failure: PeerFailed."""
        return AssertionError if set(failing) & set(self._nodes()[self.node]) else PeerFailed


def node_index() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def run(v: Verdict, node: int, sizes, masters, seed: int, count: int) -> list:
    """The steps, checked (``model_lib.run_steps``); the prefixes of the forks' names in /dev/shm."""
    steps = random_steps(seed, count, dict(KINDS, join=JOIN_WEIGHT) if len(sizes) > 1 else None)
    worlds: list = []

    def make():
        worlds.append(NodeWorld(sizes, node, masters))
        return worlds[0]
    failure = run_steps(sum(sizes), steps, None, make=make)
    prefixes = worlds[0].prefixes if worlds else []
    if failure is not None:
        text = report(seed, sum(sizes), worlds[0].master if worlds else -1, count, steps[: failure.index + 1],
                      failure, note=f", node {node} of nodes of {sizes} processes, masters {masters}")
        v.expect(False, text[-12000:])
        return prefixes
    v.expect(True, f"{count} steps")
    v.info["steps"] = len(steps)
    return prefixes


def main() -> int:
    out, sizes, masters, seed, count = sys.argv[1:6]
    sizes, masters = [int(s) for s in sizes.split(",")], [int(m) for m in masters.split(",")]
    node = node_index()
    v = Verdict(out, node)
    try:
        prefixes = run(v, node, sizes, masters, int(seed), int(count))
    except BaseException as err:  # noqa: BLE001 - written into the verdict
        return 0 if v.write(err) else 1
    left = sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in prefixes))
    (Path(out) / f"shm.{node}.txt").write_text("\n".join(left))
    return 0 if v.write() else 1


if __name__ == "__main__":
    sys.exit(main())
