"""Every collective of MpiCommunicator, against numpy, on every rank (run under mpirun).

    mpirun -np 3 python tests/mpi/comm_ops.py OUT_DIR [--quick] [--piece BYTES] [--iallgather]

With ``--piece``, every MPI transfer over BYTES goes in pieces of at most
BYTES (the path of messages over 2 GiB, exercised here on small ones). With
``--iallgather``, the header exchange is an ``Iallgather`` per step (the route of
an MPI library without MPI-4's persistent collectives); the job checks which
route it took.

Every rank builds every rank's contribution from the same seeds, so each can
compute numpy's answer on its own and compare. Ops x dtypes x sizes (small,
0-d, and about 1-2 MiB), a rank with nothing to add (None), uneven weights,
several arrays per call, non-contiguous and read-only inputs, in_place,
join/receive callbacks, dtypes MPI cannot reduce (combined locally), a
header too long for one slot, layouts that differ (ValueError everywhere) and
failure flags (PeerFailed everywhere, the communicator usable afterwards).
"""

from __future__ import annotations

import sys

import numpy as np

from common import Verdict, close_enough, conclude, expected_reduce, init_mpi, result_dtype

OPS = ("sum", "avg", "prod", "max", "min")
DTYPES = (np.bool_, np.int32, np.int64, np.float32, np.float64)
LARGE = 1 << 17  # elements: 0.5 MiB (int32/float32) to 1 MiB (int64/float64); 2 arrays a call


def make(seed: int, rank: int, dtype, shape):
    """Rank ``rank``'s contribution of case ``seed`` (the same on every rank)."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        lo = 0 if dtype.kind == "u" else -4
        return rng.integers(lo, 5, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.uniform(0.5, 1.5, shape) + 1j * rng.uniform(-1, 1, shape)).astype(dtype)
    return rng.uniform(0.5, 1.5, shape).astype(dtype)


def check_reading(v, comm, rank, size):
    """Equal header slots are read without unpickling anything; another weight or layout
    on one node reads every slot the long way, with the usual results and messages."""
    import pickle

    from synkhronos.collectives import mpi_wire

    loads = []

    class Counted:  # mpi_wire's pickle (where headers are read), counting loads
        HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
        dumps = staticmethod(pickle.dumps)

        @staticmethod
        def loads(b):
            loads.append(1)
            return pickle.loads(b)

    mpi_wire.pickle = Counted
    try:
        got = comm.all_reduce([np.full(3, rank, dtype=np.int64), np.float32(rank)], "sum")
        v.expect(not loads and int(got[0][0]) == sum(range(size)) and float(got[1]) == sum(range(size)),
                 f"equal heads: {len(loads)} loads, {got}")
        got = comm.all_reduce([np.full(3, 1.0)], "avg", weight=1.0 + rank)
        v.expect(len(loads) == size and close_enough(got[0], np.full(3, 1.0)), f"other weights: {len(loads)} loads")
        try:
            comm.all_reduce([np.zeros(3 if rank == 1 else 4)], "sum")
            v.expect(False, "other layouts raise ValueError")
        except ValueError as exc:
            v.expect("cannot sum-reduce" in str(exc) and "node 1" in str(exc), f"other layouts: {exc}")
    finally:
        mpi_wire.pickle = pickle


def check_step_plan(v, comm, rank, size):
    """A kept step plan (MpiCommunicator.plan) against numpy and against the full path
    on another node; what it refuses; a layout that differs raises on every node."""
    layout = [(np.dtype(np.float64), (3,)), (np.dtype(np.int32), ())]
    plan = comm.plan("all_reduce", layout, "sum", (("test", "sum"), "test step"))
    v.expect(plan is not None and plan.needs_exclusive and not plan.out_of_place, "a small sum plan")
    v.expect(comm.plan("all_reduce", layout, "avg", (("t",), "t")) is None, "no plan of an avg of int32")
    v.expect(comm.plan("all_reduce", [(np.dtype(np.float16), (1000,))], "sum", (("t",), "t")) is None,
             "no plan of float16 over the header slot (MPI cannot reduce it)")
    big = comm.plan("all_reduce", [(np.dtype(np.float64), (1000,)), (np.dtype(np.bool_), (300,))], "avg",
                    (("big",), "big"))
    v.expect(big is None, "no plan of an avg of booleans over the header slot")
    big = comm.plan("all_reduce", [(np.dtype(np.float64), (1000,)), (np.dtype(np.bool_), (300,))], "max",
                    (("big",), "big"))
    v.expect(big is not None and big.out_of_place, "a large plan writes out of place")
    for k in range(2):
        vals = [make(k, rank, np.float64, (1000,)), make(k, rank, np.bool_, (300,))]
        want = [expected_reduce([make(k, r, np.float64, (1000,)) for r in range(size)], "max"),
                expected_reduce([make(k, r, np.bool_, (300,)) for r in range(size)], "max")]
        outs = [np.empty_like(a) for a in vals]
        kept = [a.copy() for a in vals]
        v.expect(not big.run(vals), "a large plan without outs: False")
        v.expect(big.run(vals, outs) and all(np.array_equal(o, w) for o, w in zip(outs, want))
                 and all(np.array_equal(a, b) for a, b in zip(vals, kept)), f"large plan step {k}")
    v.expect(comm.plan("gather", layout, "sum", (("t",), "t")) is None, "no plan of a gather")
    for k in range(3):
        vals = [np.full(3, rank + k, dtype=np.float64), np.array(rank * k, dtype=np.int32)]
        if rank == 0 or k == 1:  # node 0 on the plan; the others on the full path but at k == 1
            before = comm.plan_steps  # (the plan numbers its step itself)
            v.expect(plan.run(vals) and comm.plan_steps == before + 1, f"plan step {k} ran")
        else:
            comm.begin(("test", "sum"), "test step")
            vals = comm.all_reduce(vals, "sum", in_place=True)
        v.expect(np.array_equal(vals[0], np.full(3, sum(r + k for r in range(size)), dtype=np.float64))
                 and int(vals[1]) == sum(r * k for r in range(size)), f"plan step {k}: {vals}")
    v.expect(not plan.run([np.zeros(4), np.int32(0)]), "a value of another shape: False, nothing sent")
    try:
        if rank == 0:
            plan.run([np.zeros(3), np.array(0, dtype=np.int32)])
        else:
            comm.begin(("test", "sum"), "test step")
            comm.all_reduce([np.zeros(5), np.array(0, dtype=np.int32)], "sum")
        v.expect(False, "another layout against the plan raises")
    except ValueError as exc:
        v.expect("cannot sum-reduce" in str(exc), f"another layout against the plan: {exc}")


def main() -> int:
    out = sys.argv[1]
    quick = "--quick" in sys.argv
    MPI = init_mpi()
    from synkhronos import _state
    from synkhronos.collectives import mpi_wire
    from synkhronos.collectives.mpi import MpiCommunicator, NodeFailedError

    if "--iallgather" in sys.argv:  # the header route of MPI libraries older than MPI-4
        mpi_wire.PERSISTENT_HEADERS = False
    if "--piece" in sys.argv:
        mpi_wire.PIECE_BYTES = int(sys.argv[sys.argv.index("--piece") + 1])
    from synkhronos.collectives import PeerFailed

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    v = Verdict(out, rank)
    kept_before = len(_state.mpi_leaving)  # (requests MPI may still use, kept for the process's life)
    comm = MpiCommunicator(world, master_rank=0)
    v.expect(comm.rank == rank and comm.size == size and comm.master_rank == 0, "rank/size/master_rank")
    v.expect(not comm.device_arrays and not comm.supports_resident, "capability flags")
    v.expect(comm.header.persistent == ("--iallgather" not in sys.argv), "the header exchange's route")
    seed = 0
    try:
        comm.barrier()
        # -- reductions: every op, dtype, size; all present / the last rank absent
        sizes = [(3, 4), ()] + ([] if quick else [(LARGE,)])
        for op in OPS:
            for dtype in DTYPES:
                for shape in sizes:
                    for absent in (None, size - 1):
                        for uneven in ((False, True) if op == "avg" else (False,)):
                            seed += 1
                            w = [1.0 + 0.5 * r if uneven else 1.0 for r in range(size)]
                            parts = [[make(seed, r, dtype, shape), make(seed + 10_000, r, dtype, (2,))]
                                     for r in range(size)]
                            mine = None if rank == absent else parts[rank]
                            here = [r for r in range(size) if r != absent]
                            want = [expected_reduce([parts[r][i] for r in here], op,
                                                    [w[r] for r in here]) for i in range(2)]
                            tag = f"{op} {np.dtype(dtype)} {shape} absent={absent} uneven={uneven}"
                            got = comm.all_reduce(mine, op, weight=w[rank])
                            v.expect(len(got) == 2 and all(close_enough(g, x) for g, x in zip(got, want)),
                                     f"all_reduce {tag}")
                            v.expect(got[0].dtype == result_dtype(dtype, op), f"all_reduce dtype {tag}")
                            root = seed % size
                            got = comm.reduce(mine, op, root, weight=w[rank])
                            if rank == root:
                                v.expect(got is not None and all(close_enough(g, x)
                                                                 for g, x in zip(got, want)),
                                         f"reduce root={root} {tag}")
                            else:
                                v.expect(got is None, f"reduce non-root gets None {tag}")
        # -- dtypes MPI cannot reduce itself, and narrow integers
        for dtype, op in [(np.complex128, "max"), (np.complex64, "sum"), (np.complex128, "avg"),
                          (np.float16, "sum"), (np.float16, "avg"), (np.int8, "sum"),
                          (np.uint16, "max"), (np.uint8, "avg"), (np.int8, "prod")]:
            seed += 1
            parts = [make(seed, r, dtype, (5, 3)) for r in range(size)]
            w = [1.0 + r for r in range(size)]
            got = comm.all_reduce([parts[rank]], op, weight=w[rank])
            want = expected_reduce(parts, op, w)
            v.expect(close_enough(got[0], want), f"all_reduce {op} {np.dtype(dtype)}: {got[0]} vs {want}")
        # -- nobody contributes: None everywhere
        v.expect(comm.all_reduce(None, "sum") is None, "all_reduce of nothing is None")
        v.expect(comm.reduce(None, "max", 0) is None, "reduce of nothing is None")
        # -- in_place: into the caller's arrays (zero-copy path and cast path)
        for dtype, op in [(np.float64, "sum"), (np.float32, "avg"), (np.int32, "avg"), (np.bool_, "max"),
                          (np.int64, "prod")]:
            seed += 1
            parts = [make(seed, r, dtype, (LARGE // 8,)) for r in range(size)]
            mine = parts[rank].copy()
            w = [1.0 + r for r in range(size)]
            got = comm.all_reduce([mine], op, weight=w[rank], in_place=True)
            want = expected_reduce(parts, op, w)
            if np.dtype(dtype).kind in "iu" and want.dtype.kind == "f":
                want = want.round().astype(dtype)  # lands rounded in the integer array
            v.expect(got[0] is mine and close_enough(mine, want.astype(dtype)),
                     f"in_place all_reduce {op} {np.dtype(dtype)}")
        # -- non-contiguous and read-only inputs
        seed += 1
        parts = [make(seed, r, np.float64, (6, 8)) for r in range(size)]
        got = comm.all_reduce([parts[rank][:, ::2]], "sum")
        v.expect(close_enough(got[0], expected_reduce([p[:, ::2] for p in parts], "sum")),
                 "all_reduce of a non-contiguous array")
        # -- layouts that differ: the same ValueError on every rank, then all is well
        try:
            comm.all_reduce([np.zeros(3 if rank == 1 else 4)], "sum")
            v.expect(False, "different shapes raise ValueError")
        except ValueError as exc:
            v.expect("node 1" in str(exc) or "node 0" in str(exc), f"mismatch names nodes: {exc}")
        try:
            comm.all_gather([np.zeros(1)] * (2 if rank == 0 else 1))
            v.expect(False, "different array counts raise ValueError")
        except ValueError:
            v.expect(True, "")
        # -- a header too long for one slot (many arrays) takes a second round
        many = [np.full((1,), rank * 100 + i, dtype=np.int64) for i in range(60)]
        got = comm.all_reduce(many, "sum")
        v.expect(all(int(g[0]) == sum(r * 100 + i for r in range(size)) for i, g in enumerate(got)),
                 "all_reduce of 60 arrays")
        # -- gathers: uneven rows, None, join, root 0 and last; small ones travel in the
        # headers (no gather of bytes after them), unless a node's values do not fit
        started = [0]
        start_gather = comm._start_gather

        def counted(*args):
            started[0] += 1
            return start_gather(*args)

        comm._start_gather = counted
        for absent in (None, 1):
            for large in (False, "fits", "mixed", True) if not quick else (False, "fits", "mixed"):
                seed += 1
                # ("fits": 268 bytes a node, over 256 yet within the slot after the blob)
                rows = [20 if large == "fits" else
                        (r + 1) * (LARGE // 16 if large is True or (large and r == size - 1) else 1)
                        for r in range(size)]
                started[0] = 0
                parts = [[make(seed, r, np.float32, (rows[r], 3)), make(seed, r, np.int64, ()),
                          make(seed, r, np.bool_, (rows[r],))] for r in range(size)]
                mine = None if rank == absent else parts[rank]
                want = [np.concatenate([parts[r][i].reshape(-1) for r in range(size) if r != absent])
                        for i in range(3)]

                def join(i, ps):
                    return ("j", i, [p is None for p in ps],
                            np.concatenate([p.reshape(-1) for p in ps if p is not None]))

                for root in (None, 0, size - 1):
                    tag = f"gather root={root} absent={absent} large={large}"
                    got = comm.all_gather(mine) if root is None else comm.gather(mine, root)
                    joined = (comm.all_gather(mine, join=join) if root is None
                              else comm.gather(mine, root, join=join))
                    if root is not None and rank != root:
                        v.expect(got is None and joined is None, f"{tag}: None off root")
                        continue
                    ok = len(got) == 3
                    for i in range(3):
                        for r in range(size):
                            if r == absent:
                                ok = ok and got[i][r] is None
                            else:
                                ok = ok and close_enough(got[i][r], parts[r][i])
                    v.expect(ok, tag)
                    v.expect(all(j[0] == "j" and j[1] == i and j[2] == [r == absent for r in range(size)]
                                 and close_enough(j[3], want[i]) for i, j in enumerate(joined)),
                             f"{tag} with join")
                # (every present node's fits)
                inline = large == "fits" or all(rows[r] == r + 1 for r in range(size) if r != absent)
                v.expect((started[0] == 0) == inline,
                         f"gathers absent={absent} large={large}: {started[0]} gathers of bytes")
        comm._start_gather = start_gather
        v.expect(comm.all_gather(None) == [], "all_gather of nothing is []")
        # -- broadcast: roots, receive, read-only, 0-d, large, empty
        for root in range(size):
            seed += 1
            src = [make(seed, 0, np.float64, (LARGE,)), make(seed, 0, np.int32, ()),
                   make(seed, 0, np.bool_, (0, 3)), make(seed, 0, np.complex64, (4, 2))]
            src[0].setflags(write=False)
            mine = src if rank == root else None
            got = comm.broadcast(mine, root)
            v.expect(len(got) == 4 and all(close_enough(g, s) for g, s in zip(got, src)),
                     f"broadcast root={root}")
            if rank == root:
                v.expect(all(g is s for g, s in zip(got, src)), "root gets its own arrays")
            seen = []

            def receive(i, a):
                seen.append(i)
                return ("kept", a.copy())

            got = comm.broadcast([s[::-1] if s.ndim else s for s in src] if rank == root else None,
                                 root, receive=receive)
            if rank != root:
                v.expect(seen == [0, 1, 2, 3] and all(g[0] == "kept" for g in got)
                         and close_enough(got[0][1], src[0][::-1]), f"broadcast receive root={root}")
        try:
            comm.broadcast(None, 0)
            v.expect(False, "broadcast of nothing raises")
        except ValueError as exc:
            v.expect("root node 0" in str(exc), f"broadcast of nothing names root: {exc}")
        # -- failure flags: PeerFailed everywhere, nothing combined; still usable after
        calls = [
            lambda f: comm.all_reduce([np.ones(4)], "sum", failed=f),
            lambda f: comm.reduce([np.ones(LARGE)], "avg", 0, failed=f),
            lambda f: comm.gather([np.ones(2)], size - 1, failed=f),
            lambda f: comm.all_gather([np.ones(2)], failed=f),
            lambda f: comm.broadcast([np.ones(2)] if rank == 0 else None, 0, failed=f),
        ]
        for k, call in enumerate(calls):
            try:
                call(rank == 1)
                v.expect(False, f"failed flag {k}: PeerFailed expected")
            except PeerFailed as exc:
                v.expect("[1]" in str(exc), f"PeerFailed names node 1: {exc}")
        got = comm.all_reduce([np.full(3, rank, dtype=np.int64)], "sum")
        v.expect(close_enough(got[0], np.full(3, sum(range(size)), dtype=np.int64)),
                 "usable after PeerFailed")
        check_reading(v, comm, rank, size)
        check_step_plan(v, comm, rank, size)
        comm.barrier()
        v.info["node_failed_error"] = NodeFailedError.__name__
        comm.close()
        try:
            comm.barrier()
            v.expect(False, "a call after close raises")
        except Exception as exc:  # noqa: BLE001
            v.expect("closed" in str(exc), f"call after close: {exc}")
        v.expect(len(_state.mpi_leaving) == kept_before, "a clean close frees the header exchange's request")
        for cycle in range(4):  # communicators made and closed again: nothing kept, the same answers
            again = MpiCommunicator(world, master_rank=0)
            for step in range(3):
                got = again.all_reduce([np.full(2, rank + step, dtype=np.int64)], "max")
                v.expect(close_enough(got[0], np.full(2, size - 1 + step, dtype=np.int64)), f"cycle {cycle}")
            again.close()
            v.expect(len(_state.mpi_leaving) == kept_before, f"cycle {cycle}: the header's request freed")
    except BaseException as exc:  # noqa: BLE001 - written down, then a non-zero exit
        return conclude(v, MPI, comm, exc)
    return conclude(v, MPI)


if __name__ == "__main__":
    sys.exit(main())
