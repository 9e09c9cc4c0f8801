"""torch.distributed with gloo on 127.0.0.1: all-reduce, broadcast and barrier.

Two processes started with torch.multiprocessing; timing as in peer_mpi.py
(a barrier before each repetition, the slowest rank's time). Rank 0 writes
the JSON.
"""

from __future__ import annotations

import os
import socket
import time

import benchlib as bl


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, path: str, quick: bool) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep every byte on the loopback
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def timed(op, reps: int, warmup: int = 3) -> dict:
        for _ in range(warmup):
            dist.barrier()
            op()
        times = torch.empty(reps, dtype=torch.float64)
        for i in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times[i] = time.perf_counter() - t0
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return bl.summarize(times.tolist())

    out = {"size": world, "torch": torch.__version__, "backend": "gloo", "all_reduce": {}, "broadcast": {}}
    for nbytes in bl.sizes_for(quick):
        # gloo's 4 B and 4 KiB latencies are ~100x MPI's: fewer reps keep the run short
        reps = bl.reps_for(nbytes, quick)
        reps = min(reps, 300 if not quick else 50)
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        lab = bl.label(nbytes)
        out["all_reduce"][lab] = timed(lambda: dist.all_reduce(t), reps)
        out["broadcast"][lab] = timed(lambda: dist.broadcast(t, src=0), reps)
        del t
    reps = 50 if quick else 300
    per = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.barrier()
        per.append((time.perf_counter() - t0) / reps)
    out["barrier"] = bl.summarize(per)
    dist.destroy_process_group()
    if rank == 0:
        bl.write_part(path, out)


def main() -> None:
    args = bl.part_args(__doc__.splitlines()[0])
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_worker, args=(world, _free_port(), args.json, args.quick), nprocs=world, join=True)


if __name__ == "__main__":
    main()
