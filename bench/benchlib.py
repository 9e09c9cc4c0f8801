"""What every benchmark part shares: sizes, repetition counts, timing, JSON out.

Each part (synkhronos and each peer) runs in its own subprocess and writes
one JSON object to the path given by ``--json``; ``run.py`` collects them.
Every loop here is bounded by a repetition count, and timed loops also by a
time budget, so no part can run away.
"""

from __future__ import annotations

import argparse
import json
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Callable

__all__ = ["SIZES", "QUICK_SIZES", "sizes_for", "reps_for", "measure", "summarize",
           "part_args", "write_part", "label", "cpu_busy", "ForeignLoad", "IDLE_GAPS", "busy", "gap_key"]

#: Collective sizes in bytes (float32 elements = bytes // 4): 4 B to 64 MiB, the
#: latency-against-size curve of issue 18 (issue 6's 4 B, 4 KiB, 4 MiB, 64 MiB among them).
SIZES = [4, 256, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
#: --quick keeps a few small sizes and drops the large ones.
QUICK_SIZES = [4, 4 << 10, 4 << 20]


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_label(when: str | None = None, cores: int | None = None) -> str:
    """What every plot carries in its corner: the CPU, its core count and the date of the run."""
    day = (when or datetime.date.today().isoformat())[:10]
    return f"{cpu_model()}, {cores or os.cpu_count()} cores, {day}"


def stamp(fig, text: str) -> None:
    """Write the machine label into a matplotlib figure's lower right corner."""
    fig.text(0.995, 0.005, text, ha="right", va="bottom", fontsize=7, color="0.35")


def sizes_for(quick: bool) -> list[int]:
    return QUICK_SIZES if quick else SIZES


def label(nbytes: int) -> str:
    """4 -> '4B', 4096 -> '4KiB', 4 MiB -> '4MiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def reps_for(nbytes: int, quick: bool) -> int:
    """Fixed repetitions per size, the same in every process of an SPMD peer.

    (Processes of MPI and gloo must run the same number of collectives, so
    these loops count rather than watch the clock.)
    """
    if nbytes <= 64 << 10:
        n = 2000
    elif nbytes <= 8 << 20:
        n = 60
    else:
        n = 15
    return max(5, n // 10) if quick else n


#: Idle gaps (seconds) before a call, as a loop with other work between its calls has them.
IDLE_GAPS = (1e-3, 5e-3, 10e-3)


def busy(seconds: float) -> None:
    """Work in this process (Python, no system call) for ``seconds``: the gap
    of a loop that does other work between its calls."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gap_key(gap: float, how: str = "busy") -> str:
    """How the results after a gap are named: '5ms busy', '5ms' (sleep)."""
    return f"{gap * 1e3:g}ms busy" if how == "busy" else f"{gap * 1e3:g}ms"


def summarize(times: list[float]) -> dict:
    """Median and spread (seconds) of a list of per-call times."""
    if not times:
        return {"median": None, "min": None, "p25": None, "p75": None, "n": 0}
    qs = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median": statistics.median(times), "min": min(times),
            "p25": qs[0], "p75": qs[2], "n": len(times)}


def mpi_slowest(comm, op: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Per repetition of ``op`` under MPI, each after a barrier, the slowest
    rank's time (seconds), known to every rank."""
    import numpy as np
    from mpi4py import MPI

    for _ in range(warmup):
        comm.Barrier()
        op()
    times = np.empty(reps)
    for i in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        op()
        times[i] = time.perf_counter() - t0
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return slowest.tolist()


def measure(fn: Callable[[], object], *, warmup: int = 3, min_reps: int = 5,
            max_reps: int = 2000, budget_s: float = 1.0, warmup_s: float = 0.0) -> dict:
    """Time ``fn()`` call by call after ``warmup`` calls (and at least ``warmup_s``
    seconds of calls); median and spread.

    Stops after ``max_reps`` calls, or once ``budget_s`` has passed and at
    least ``min_reps`` calls were timed.
    """
    for _ in range(warmup):
        fn()
    warm_until = time.perf_counter() + warmup_s
    while time.perf_counter() < warm_until:
        fn()
    times = []
    end = time.perf_counter() + budget_s
    while len(times) < max_reps:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= min_reps and time.perf_counter() > end:
            break
    return summarize(times)


def part_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """The arguments every part takes: --json PATH, --quick, plus its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", required=True, help="where to write this part's results")
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    if extra is not None:
        extra(p)
    return p.parse_args()


def write_part(path: str, result: dict) -> None:
    """Write a part's results atomically (run.py reads the file after the process ends)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(obj):
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:
        pass
    return str(obj)


def _proc_stat():
    """(total, busy) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest time is already counted in user
    return total / hz, (total - idle) / hz


class ForeignLoad:
    """How much of the machine other programs used while a block ran.

    Busy CPU time of the whole machine (``/proc/stat``) minus the CPU time of
    this process and its reaped children (``getrusage``), over the CPU time
    the machine had: 0 on a quiet machine, ~0.5 when another program kept
    one of two cores busy all along.
    """

    def __enter__(self):
        self._t0 = self._read()
        return self

    def __exit__(self, *exc):
        self.share = self.since(self._t0)
        return False

    @staticmethod
    def _read():
        import resource

        try:
            total, busy = _proc_stat()
        except (OSError, ValueError):
            return None
        own = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            ru = resource.getrusage(who)
            own += ru.ru_utime + ru.ru_stime
        return total, busy, own

    @classmethod
    def since(cls, start) -> float | None:
        end = cls._read()
        if start is None or end is None or end[0] <= start[0]:
            return None
        foreign = (end[1] - start[1]) - (end[2] - start[2])
        return max(0.0, foreign / (end[0] - start[0]))


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPU time that was busy over ``interval`` seconds (from /proc/stat)."""

    def read():
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        t0, i0 = read()
        time.sleep(interval)
        t1, i1 = read()
    except OSError:
        return float("nan")
    total = t1 - t0
    return 0.0 if total <= 0 else 1.0 - (i1 - i0) / total


if __name__ == "__main__":  # pragma: no cover
    sys.exit("benchlib is a library; run bench/run.py")
