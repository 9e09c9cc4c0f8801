"""Floors and the standard-library peer: numpy copy, semaphore round trip, multiprocessing.Pool.

- numpy copy: ``np.copyto`` of a float32 array of each size into a
  preallocated one, in one process: the least any collective of that size
  can cost (it must move the bytes at least once).
- semaphore round trip: two processes pass a POSIX semaphore back and forth
  (the waker of a sleeping process), blocking and spinning.
- ``multiprocessing.Pool(2).map`` of two trivial tasks per call: what
  per-call overhead of the standard library looks like.
- the Python floor of a 4-byte all-reduce: two processes, both spinning on
  a word of shared memory, the master writes its value and a sequence
  number, the partner adds its own and answers; no checks, no dispatch, no
  sleeping. What any Python master/worker design pays at the least; also
  after busy gaps of the master, the floor of a call after idle workers.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time

import numpy as np

import benchlib as bl

args = bl.part_args(__doc__.splitlines()[0])
BUDGET = 0.25 if args.quick else 1.0


def numpy_copy() -> dict:
    out = {}
    for nbytes in bl.sizes_for(args.quick):
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        out[bl.label(nbytes)] = bl.measure(lambda: np.copyto(dst, src), warmup=3,
                                           max_reps=bl.reps_for(nbytes, args.quick), budget_s=BUDGET)
    return out


def semaphore_round_trip(spin: bool) -> dict:
    """Median time for ping -> pong between two processes through two POSIX semaphores."""
    import posix_ipc

    reps = 200 if args.quick else 2000
    warmup = 20
    tag = f"/synkbench.{os.getpid()}.{int(spin)}"
    ping = posix_ipc.Semaphore(tag + "a", posix_ipc.O_CREX, initial_value=0)
    pong = posix_ipc.Semaphore(tag + "b", posix_ipc.O_CREX, initial_value=0)

    def take(sem):
        if spin:
            end = time.monotonic() + 5.0
            while True:
                try:
                    sem.acquire(0)
                    return
                except posix_ipc.BusyError:
                    if time.monotonic() > end:
                        raise TimeoutError("partner did not answer in 5 s")
        else:
            sem.acquire(5.0)

    try:
        pid = os.fork()
        if pid == 0:  # the partner: answer exactly warmup + reps pings, then leave
            code = 0
            try:
                for _ in range(warmup + reps):
                    take(ping)
                    pong.release()
            except BaseException:
                code = 1
            os._exit(code)
        times = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            ping.release()
            take(pong)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        os.waitpid(pid, 0)
        return bl.summarize(times)
    finally:
        for sem in (ping, pong):
            sem.unlink()
            sem.close()


def python_floor_all_reduce() -> tuple[dict, dict]:
    """Median time of the least a Python master and worker can do for a 4-byte
    all-reduce through shared memory (see the module's docstring): in a tight
    loop, and after each busy gap of the master (``benchlib.IDLE_GAPS``, the
    partner spinning all along), which tells what the machine itself does to
    a Python round trip after a pause: the floor of issue 18's after-idle goal.
    The two processes sit on cores 0 and 1, as synkhronos pins a fork's first two."""
    reps, warmup, gap_reps = (2000, 200, 40) if args.quick else (20000, 2000, 200)
    buf = mmap.mmap(-1, 4096)
    words = memoryview(buf).cast("q")  # word 0: the master's sequence number, word 1: the partner's
    values = np.frombuffer(buf, np.float32, 2, 64)  # the master's value, the sum
    end = time.monotonic() + 60.0  # neither side spins on for ever if the other one is gone
    pid = os.fork()
    if pid == 0:
        _pin(1)
        mine, seen = np.float32(1.5), 0
        while True:
            spins = 0
            while words[0] == seen:
                spins += 1
                if not spins & 0xFFFF and time.monotonic() > end:
                    os._exit(1)
            seen = words[0]
            if seen < 0:  # the master is done (or gave up)
                os._exit(0)
            values[1] = values[0] + mine
            words[1] = seen
    seq = 0

    def round_trip() -> float:
        nonlocal seq
        seq += 1
        t0 = time.perf_counter()
        values[0] = 2.0
        words[0] = seq
        spins = 0
        while words[1] != seq:
            spins += 1
            if not spins & 0xFFFF and time.monotonic() > end:
                raise TimeoutError("the partner of the Python floor did not answer")
        values[1]
        return time.perf_counter() - t0

    affinity = _pin(0)
    try:
        for _ in range(warmup):
            round_trip()
        tight = bl.summarize([round_trip() for _ in range(reps)])
        after = {}
        for gap in bl.IDLE_GAPS:
            times = []
            for _ in range(gap_reps):
                bl.busy(gap)
                times.append(round_trip())
            after[bl.gap_key(gap)] = bl.summarize(times)
    finally:
        words[0] = -1  # a partner still waiting leaves at its deadline at the latest
        os.waitpid(pid, 0)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
    return tight, after


def _pin(core: int):
    """Run this process on ``core`` where the machine has two cores or more;
    the cores it could run on before, or None where it was left alone."""
    before = os.sched_getaffinity(0)
    if len(before) < 2 or core not in before:
        return None
    os.sched_setaffinity(0, {core})
    return before


def _noop(x):
    return x


def pool_map() -> dict:
    with multiprocessing.get_context("fork").Pool(2) as pool:
        return bl.measure(lambda: pool.map(_noop, [0, 1]), warmup=20, max_reps=2000, budget_s=BUDGET)


def main() -> None:
    out = {"numpy_copy": numpy_copy(), "pool_map": pool_map()}
    try:
        out["semaphore_round_trip"] = semaphore_round_trip(spin=False)
        out["semaphore_round_trip_spin"] = semaphore_round_trip(spin=True)
    except ImportError as err:
        out["semaphore_round_trip"] = {"skipped": f"posix_ipc not importable: {err}"}
    out["python_floor_all_reduce"], out["python_floor_after_busy"] = python_floor_all_reduce()
    bl.write_part(args.json, out)


if __name__ == "__main__":
    main()
