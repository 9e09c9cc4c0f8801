"""Messages over 2 GiB through MpiCommunicator (run under mpirun -np 2).

    mpirun -np 2 python tests/mpi/comm_large.py OUT_DIR

MPI 3.1 counts elements and displacements in C ints, so a message of
2**31 - 1 bytes or more must travel in pieces. Here, each of 2**31 + 64
bytes: a broadcast from node 1, an all_reduce (max of uint8: 2**31 + 64
elements in one array), a reduce to node 1 (sum of float32, over 2 GiB), and
an all_gather and a gather whose parts are 2**30 + 32 bytes each (the
displacements pass a C int). Every result is compared with numpy, chunk by
chunk. Each rank needs about 5 GiB at its peak.
"""

from __future__ import annotations

import sys

import numpy as np

from common import Verdict, conclude, init_mpi

BIG = 2 ** 31 + 64
CHUNK = 1 << 26


def pattern(n: int, rank: int, dtype=np.uint8) -> np.ndarray:
    """``n`` values of a rank's own repeating pattern (251: prime, so no piece lines up)."""
    base = ((np.arange(251) * (rank + 3)) % 251).astype(dtype)
    return np.resize(base, n)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = a.reshape(-1), b.reshape(-1)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return all(np.array_equal(a[i:i + CHUNK], b[i:i + CHUNK]) for i in range(0, a.size, CHUNK))


def main() -> int:
    out = sys.argv[1]
    MPI = init_mpi()
    from synkhronos.collectives.mpi import MpiCommunicator

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    v = Verdict(out, rank)
    comm = MpiCommunicator(world, master_rank=0)
    try:
        # broadcast from node 1
        mine = pattern(BIG, 1) if rank == 1 else None
        got = comm.broadcast([mine] if mine is not None else None, root=1)[0]
        v.expect(same(got, pattern(BIG, 1)), "broadcast of 2 GiB + 64 B")
        del got, mine
        # all_reduce: max of uint8, 2**31 + 64 elements
        got = comm.all_reduce([pattern(BIG, rank)], "max")[0]
        want = np.maximum(pattern(BIG, 0), pattern(BIG, 1))
        v.expect(same(got, want), "all_reduce max of 2**31 + 64 uint8")
        del got, want
        # reduce to node 1: sum of float32, 2 GiB + 64 B
        got = comm.reduce([pattern(BIG // 4, rank, np.float32)], "sum", root=1)
        if rank == 1:
            want = pattern(BIG // 4, 0, np.float32) + pattern(BIG // 4, 1, np.float32)
            v.expect(got is not None and same(got[0], want), "reduce sum of 2 GiB + 64 B of float32")
            del want
        else:
            v.expect(got is None, "reduce: None off the root")
        del got
        # all_gather and gather: parts of 2**30 + 32 bytes, 2 GiB + 64 B in all
        half = BIG // 2
        got = comm.all_gather([pattern(half, rank)])[0]
        v.expect(len(got) == size and all(same(got[r], pattern(half, r)) for r in range(size)),
                 "all_gather of 2 x (1 GiB + 32 B)")
        del got
        got = comm.gather([pattern(half, rank)], root=0)
        if rank == 0:
            v.expect(got is not None and all(same(got[0][r], pattern(half, r)) for r in range(size)),
                     "gather of 2 x (1 GiB + 32 B)")
        else:
            v.expect(got is None, "gather: None off the root")
        del got
        comm.close()
    except BaseException as exc:  # noqa: BLE001 - written down, then a non-zero exit
        return conclude(v, MPI, comm, exc)
    return conclude(v, MPI)


if __name__ == "__main__":
    sys.exit(main())
