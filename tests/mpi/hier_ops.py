"""HierarchicalCommunicator over MPI ranks that each host a node of 2 processes
(run under mpirun by tests/test_mpi_comm.py).

    mpirun -np 2 python tests/mpi/hier_ops.py OUT_DIR

Each MPI rank is a node: its main thread is the node master (shared-memory
communicator rank 0, plus the MPI communicator), a second thread is its
worker (shared-memory rank 1); ranks are threads here, as in
tests/test_nccl_logic.py, since a process forked after MPI_Init is what the
runtime avoids. Global ranks are node-major. Every process checks every
collective against numpy and writes ``verdict.<global rank>.json``.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from common import Verdict, close_enough, expected_reduce, init_mpi

LOCAL = 2
OPS = ("sum", "avg", "prod", "max", "min")
DTYPES = (np.bool_, np.int32, np.int64, np.float32, np.float64)


def make(seed, rank, dtype, shape):
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-4, 5, size=shape).astype(dtype)
    return rng.uniform(0.5, 1.5, shape).astype(dtype)


def body(hc, v, PeerFailed):
    rank, size = hc.rank, hc.size
    seed = 0
    hc.barrier()
    # -- reductions: none absent, a worker absent, a whole node absent
    patterns = [(), (1,), tuple(range(size - LOCAL, size))]
    for op in OPS:
        for dtype in DTYPES:
            for shape in ((3, 2), (1 << 16,)) if dtype in (np.float64, np.int32) else ((3, 2),):
                for absent in patterns:
                    seed += 1
                    w = [1.0 + 0.5 * r for r in range(size)] if op == "avg" else [1.0] * size
                    parts = [make(seed, r, dtype, shape) for r in range(size)]
                    here = [r for r in range(size) if r not in absent]
                    want = expected_reduce([parts[r] for r in here], op, [w[r] for r in here])
                    mine = None if rank in absent else [parts[rank]]
                    tag = f"{op} {np.dtype(dtype)} {shape} absent={absent}"
                    got = hc.all_reduce(mine, op, weight=w[rank])
                    v.expect(got is not None and close_enough(got[0], want), f"all_reduce {tag}")
                    root = seed % size
                    got = hc.reduce(mine, op, root, weight=w[rank])
                    if rank == root:
                        v.expect(got is not None and close_enough(got[0], want), f"reduce root={root} {tag}")
                    else:
                        v.expect(got is None, f"reduce off root {tag}")
    v.expect(hc.all_reduce(None, "sum") is None, "all_reduce of nothing")
    # -- in_place: rounded into integer arrays
    seed += 1
    parts = [make(seed, r, np.int32, (7,)) for r in range(size)]
    mine = parts[rank].copy()
    got = hc.all_reduce([mine], "avg", in_place=True)
    v.expect(got[0] is mine and close_enough(mine, expected_reduce(parts, "avg").round().astype(np.int32)),
             "in_place avg of int32")
    # -- gathers: node order, then rank order; None; join; every root
    for absent in ((), (1,), (2, 3)):
        seed += 1
        parts = [[make(seed, r, np.float32, (r + 1, 2)), make(seed, r, np.int64, ())] for r in range(size)]
        mine = None if rank in absent else parts[rank]

        def join(i, ps):
            return [p is None for p in ps], np.concatenate([p.reshape(-1) for p in ps if p is not None])

        for root in (None, *range(size)):
            tag = f"gather root={root} absent={absent}"
            got = hc.all_gather(mine) if root is None else hc.gather(mine, root)
            joined = hc.all_gather(mine, join=join) if root is None else hc.gather(mine, root, join=join)
            if root is not None and rank != root:
                v.expect(got is None and joined is None, f"{tag}: None off root")
                continue
            ok = len(got) == 2 and all(
                (got[i][r] is None) if r in absent else close_enough(got[i][r], parts[r][i])
                for i in range(2) for r in range(size))
            v.expect(ok, tag)
            v.expect(all(j[0] == [r in absent for r in range(size)] and close_enough(
                j[1], np.concatenate([parts[r][i].reshape(-1) for r in range(size) if r not in absent]))
                for i, j in enumerate(joined)), f"{tag} join")
    # -- broadcast from every rank (workers too), with receive
    for root in range(size):
        seed += 1
        src = [make(seed, root, np.float64, (1 << 15,)), make(seed, root, np.bool_, (3,))]
        got = hc.broadcast(src if rank == root else None, root,
                           receive=lambda i, a: ("kept", np.array(a)))
        if rank == root:
            v.expect(all(g is s for g, s in zip(got, src)), f"broadcast root={root}: own arrays")
        else:
            v.expect(all(g[0] == "kept" and close_enough(g[1], s) for g, s in zip(got, src)),
                     f"broadcast root={root}")
    # -- a failure flagged by a worker of the last node, or by the root: PeerFailed everywhere
    bad = size - 1
    calls = [("all_reduce", lambda f: hc.all_reduce([np.ones(3)], "sum", failed=f)),
             ("reduce avg", lambda f: hc.reduce([np.ones(3)], "avg", 0, failed=f)),
             ("gather", lambda f: hc.gather([np.ones(3)], 1, failed=f)),
             ("all_gather", lambda f: hc.all_gather([np.ones(3)], failed=f)),
             ("broadcast", lambda f: hc.broadcast([np.ones(3)] if rank == bad else None, bad, failed=f)),
             ("broadcast from 0", lambda f: hc.broadcast([np.ones(3)] if rank == 0 else None, 0,
                                                         failed=f and rank == 0))]
    for k, (name, call) in enumerate(calls):
        flag = rank == (0 if name == "broadcast from 0" else bad)
        try:
            call(flag)
            v.expect(False, f"{name}: PeerFailed expected (rank {rank})")
        except PeerFailed:
            v.expect(True, "")
        got = hc.all_reduce([np.full(2, rank, dtype=np.int64)], "sum")
        v.expect(close_enough(got[0], np.full(2, sum(range(size)), dtype=np.int64)),
                 f"usable after failed {name}")
    hc.barrier()


def main() -> int:
    out = sys.argv[1]
    MPI = init_mpi()
    from synkhronos.collectives import PeerFailed, ShmCommunicator
    from synkhronos.collectives.hier import HierarchicalCommunicator
    from synkhronos.collectives.mpi import MpiCommunicator
    from synkhronos._procs.shmem import new_prefix, unlink_prefix

    world = MPI.COMM_WORLD
    node = world.Get_rank()
    prefix = new_prefix()
    shms = [ShmCommunicator(prefix, 0, LOCAL, 0, create=True)]
    shms += [ShmCommunicator(prefix, r, LOCAL, 0, create=False) for r in range(1, LOCAL)]
    verdicts, ok = {}, {}

    def run(local_rank):
        inter = MpiCommunicator(world, 0) if local_rank == 0 else None
        v = Verdict(out, node * LOCAL + local_rank)  # replaced by the global rank below
        try:
            hc = HierarchicalCommunicator(shms[local_rank], inter)
            v.rank = hc.rank
            v.path = v.path.with_name(f"verdict.{hc.rank}.json")
            v.expect(hc.rank == node * LOCAL + local_rank and hc.size == world.Get_size() * LOCAL
                     and hc.node == node and hc.master_rank == 0 and hc.node_sizes == [LOCAL] * hc.nodes,
                     f"identity {hc.rank} {hc.size} {hc.node} {hc.master_rank} {hc.node_sizes}")
            body(hc, v, PeerFailed)
            hc.close()
            ok[local_rank] = v.write()
        except BaseException as exc:  # noqa: BLE001
            if inter is not None:
                inter.abort(f"{type(exc).__name__}: {exc}")
            ok[local_rank] = v.write(exc)
        verdicts[local_rank] = v

    threads = [threading.Thread(target=run, args=(r,)) for r in range(1, LOCAL)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join(60)
    # close() unlinks what each rank created; the sweep also covers a rank that failed before it
    unlink_prefix(prefix)
    left = [e for e in os.listdir("/dev/shm") if prefix in e]
    with open(os.path.join(out, f"shm.{node}.txt"), "w") as fh:
        fh.write("\n".join(left))
    MPI.Finalize()
    return 0 if all(ok.get(r) for r in range(LOCAL)) else 1


if __name__ == "__main__":
    sys.exit(main())
