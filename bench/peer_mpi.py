"""Open MPI through mpi4py: all-reduce, broadcast, gather, reduce and barrier (run under mpirun).

Every rank runs the same fixed number of repetitions; before each one a
barrier lines the ranks up, and the time of a repetition is the slowest
rank's, which is what a synkhronos call (it returns once every process is
done) compares with. Rank 0 writes the JSON.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import benchlib as bl

args = bl.part_args(__doc__.splitlines()[0])
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def timed(op, reps: int, warmup: int = 3) -> dict:
    return bl.summarize(bl.mpi_slowest(comm, op, reps, warmup))


def main() -> None:
    out = {"size": size, "library": MPI.Get_library_version().replace("\0", "").strip().splitlines()[0],
           "mpi4py": __import__("mpi4py").__version__,
           "all_reduce": {}, "broadcast": {}, "gather": {}, "reduce": {}}
    for nbytes in bl.sizes_for(args.quick):
        n = nbytes // 4
        reps = bl.reps_for(nbytes, args.quick)
        send = np.ones(n, np.float32)
        recv = np.empty_like(send)
        gathered = np.empty((size, n), np.float32) if rank == 0 else None
        lab = bl.label(nbytes)
        out["all_reduce"][lab] = timed(lambda: comm.Allreduce(send, recv, op=MPI.SUM), reps)
        out["broadcast"][lab] = timed(lambda: comm.Bcast(send, root=0), reps)
        out["gather"][lab] = timed(lambda: comm.Gather(send, gathered, root=0), reps)
        out["reduce"][lab] = timed(lambda: comm.Reduce(send, recv, op=MPI.SUM, root=0), reps)
        del send, recv, gathered
    # barrier: many in a row, per-barrier time from the total
    reps = 200 if args.quick else 2000
    per = []
    for _ in range(5):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            comm.Barrier()
        per.append((time.perf_counter() - t0) / reps)
    out["barrier"] = bl.summarize(per)
    if rank == 0:
        bl.write_part(args.json, out)


main()
