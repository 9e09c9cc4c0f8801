"""synkhronos's side of the benchmark, run by run.py in a subprocess.

Parts:
  first  2 processes: the MLP's first call in the master vs the workers'
         first call after distribute() (run.py gives it an empty compile cache).
  main   2 processes: per-call overhead, scatter, output reductions,
         shared-variable collectives.
  train  MLP training steps with --n processes; --pin-one-core keeps the
         process (and so its BLAS) to one core, the fair baseline for the
         2-process scaling target.

Times are seconds, taken in the master: a synkhronos call returns once every
process has finished its share, so they compare with the peers' "slowest
rank" times.
"""

from __future__ import annotations

import os
import sys
import time

import benchlib as bl


def _extra(p):
    p.add_argument("--part", choices=("first", "main", "train"), default="main")
    p.add_argument("--n", type=int, default=2, help="processes (master included)")
    p.add_argument("--pin-one-core", action="store_true",
                   help="restrict this process to one core before forking (1-process baseline)")


args = bl.part_args(__doc__.splitlines()[0], _extra)
if args.pin_one_core:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import synkhronos as synk  # noqa: E402  (affinity first: fork() sizes threads from it)

synk.fork(args.n, device="cpu")

import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

QUICK = args.quick
BUDGET = 0.25 if QUICK else 1.5          # seconds of timed calls per point
TINY_REPS = 300 if QUICK else 3000       # cap on calls per point for tiny calls
#: MLP: inputs -> hidden -> hidden -> classes.
D_IN, HIDDEN, N_CLASSES = 256, 256, 10
TRAIN_BATCHES = [64, 512] if QUICK else [256, 1024, 4096, 16384]


def us(summary: dict) -> float:
    return summary["median"] * 1e6


# ---------------------------------------------------------------------------
# the MLP


def build_mlp(seed: int = 0):
    """A PyTensor MLP with SGD updates, as a synk function; returns (f, params)."""
    rng = np.random.default_rng(seed)
    sizes = [D_IN, HIDDEN, HIDDEN, N_CLASSES]
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        params.append(pytensor.shared(w, name=f"W{i}"))
        params.append(pytensor.shared(np.zeros(b, np.float32), name=f"b{i}"))
    x = pt.fmatrix("x")
    y = pt.ivector("y")
    h = x
    for i in range(3):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < 2:
            h = pt.maximum(h, 0)
    logp = pt.special.log_softmax(h, axis=-1)
    loss = -logp[pt.arange(y.shape[0]), y].mean()
    grads = pytensor.grad(loss, params)
    lr = np.float32(0.01)
    updates = [(p, p - lr * g) for p, g in zip(params, grads)]
    f = synk.function([x, y], loss, updates=updates, name="mlp_step")
    return f, params


def batch_data(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, D_IN)).astype(np.float32),
            rng.integers(0, N_CLASSES, n).astype(np.int32))


def first_call(f) -> dict:
    """The master's first call of a fresh function vs the workers' first call after distribute()."""
    xs, ys = batch_data(256)
    t0 = time.perf_counter()
    f.as_pytensor(xs, ys)
    master_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    f.as_pytensor(xs, ys)
    master_second = time.perf_counter() - t0
    t0 = time.perf_counter()
    synk.distribute()
    dist = time.perf_counter() - t0
    t0 = time.perf_counter()
    f(xs, ys)
    dist_first = time.perf_counter() - t0
    steady = bl.measure(lambda: f(xs, ys), warmup=2, max_reps=200, budget_s=BUDGET)
    return {"master_first_call_s": master_first, "master_second_call_s": master_second,
            "distribute_s": dist, "workers_first_call_s": dist_first,
            "distributed_steady_call_s": steady["median"]}


def train(f, params) -> dict:
    """Throughput of one data-parallel step (call + all_reduce of the parameters) per batch size."""
    out = {}
    for n in TRAIN_BATCHES:
        xs, ys = batch_data(n)
        xd, yd = synk.data(xs), synk.data(ys)

        def step():
            f(xd, yd)
            synk.all_reduce(params, op="avg")

        s = bl.measure(step, warmup=2, min_reps=3, max_reps=500, budget_s=BUDGET * 1.5)
        out[str(n)] = {"step": s, "samples_per_s": n / s["median"]}
        xd.free_memory()
        yd.free_memory()
    ar = bl.measure(lambda: synk.all_reduce(params, op="avg"), warmup=3, max_reps=500, budget_s=BUDGET)
    return {"n_parallel": args.n, "threads_per_process": max(1, len(os.sched_getaffinity(0)) // args.n),
            "pinned_one_core": bool(args.pin_one_core), "batches": out, "param_all_reduce": ar,
            "model": f"{D_IN}-{HIDDEN}-{HIDDEN}-{N_CLASSES} MLP, float32, SGD",
            "param_bytes": int(sum(p.get_value(borrow=True).nbytes for p in params))}


# ---------------------------------------------------------------------------
# per-call overhead, scatter, output reductions


def overhead() -> dict:
    """A tiny function, distributed vs plain PyTensor, and what each part of a call adds."""
    x = pt.fvector("x")
    tiny = synk.function([x], x.sum(), name="tiny")
    tiny_none = synk.function([x], (x.sum(), None), name="tiny_no_reduce")
    empty = synk.function([], None, name="empty")
    w4k = pytensor.shared(np.ones(1024, np.float32), name="w4k")  # a 4 KiB output
    out4k = synk.function([x], _out_4kib(w4k, x), name="out_4KiB")
    out4k_none = synk.function([x], (_out_4kib(w4k, x)[0], None), name="out_4KiB_no_reduce")
    v4 = pytensor.shared(np.zeros(1, np.float32), name="v4")  # a 4-byte shared variable
    synk.function([], v4.sum(), name="v4_holder")
    synk.distribute()
    a = np.ones(8, np.float32)
    d = synk.data(a)
    # microsecond calls: warm up for a while (caches, the scheduler, the CPU's
    # clock), not only a few calls, or the first series measures the ramp
    kw = dict(warmup=20, max_reps=TINY_REPS, budget_s=BUDGET, warmup_s=0.05 if QUICK else 0.3)
    # On the 2-core VM the first second or two of calls after fork() run
    # ~1.6x slower whatever they are (seen with numpy and synk.data inputs
    # alike), then settle: measure the steady state a training loop sees.
    settle_until = time.perf_counter() + (0.2 if QUICK else 2.0)
    while time.perf_counter() < settle_until:
        tiny(a)
    res = {
        "pytensor_call": bl.measure(lambda: tiny.as_pytensor(a), **kw),
        "synk_call_numpy": bl.measure(lambda: tiny(a), **kw),
        "synk_call_data": bl.measure(lambda: tiny(d), **kw),
        "synk_call_numpy_no_reduce": bl.measure(lambda: tiny_none(a), **kw),
        "synk_call_data_no_reduce": bl.measure(lambda: tiny_none(d), **kw),
        "synk_call_empty": bl.measure(lambda: empty(), **kw),
        "synk_call_out_4KiB": bl.measure(lambda: out4k(a), **kw),
        "synk_call_out_4KiB_no_reduce": bl.measure(lambda: out4k_none(a), **kw),
    }
    res.update(alternating(lambda: tiny(a), lambda: tiny_none(a), lambda: synk.all_reduce(v4, op="sum"), kw))
    res["after_idle"] = after_idle(lambda: tiny(a), lambda: tiny.as_pytensor(a))
    res["idle_cpu"] = idle_cpu(lambda: tiny(a))
    pt_us = us(res["pytensor_call"])
    res["overhead_us"] = us(res["synk_call_numpy"]) - pt_us
    res["overhead_data_us"] = us(res["synk_call_data"]) - pt_us
    res["breakdown_us"] = {
        "control round trip (empty function)": us(res["synk_call_empty"]),
        "+ own compute, input refs (synk.data, no reduce)":
            us(res["synk_call_data_no_reduce"]) - us(res["synk_call_empty"]),
        "+ scatter copy of a numpy input":
            us(res["synk_call_numpy_no_reduce"]) - us(res["synk_call_data_no_reduce"]),
        "+ avg reduction of a 0-d output":
            us(res["synk_call_numpy"]) - us(res["synk_call_numpy_no_reduce"]),
        "avg reduction of a 4 KiB output (vs none)":
            us(res["synk_call_out_4KiB"]) - us(res["synk_call_out_4KiB_no_reduce"]),
        "two functions in turn: a pair minus each alone":
            us(res["pair_two_functions"]) - us(res["synk_call_numpy"]) - us(res["synk_call_numpy_no_reduce"]),
        "a call and a 4 B all_reduce in turn: minus each alone":
            us(res["pair_call_all_reduce"]) - us(res["synk_call_numpy"]) - us(res["all_reduce_4B"]),
    }
    d.free_memory()
    return res


def alternating(call, other_call, collective, kw) -> dict:
    """Loops that alternate, as training loops do (a step, then an all_reduce;
    two functions): each pair against its parts alone, measured now too."""
    return {
        "all_reduce_4B": bl.measure(collective, **kw),
        "pair_two_functions": bl.measure(lambda: (call(), other_call()), **kw),
        "pair_call_all_reduce": bl.measure(lambda: (call(), collective()), **kw),
    }


def _out_4kib(w, x):
    """A 4 KiB float32 output (1024 elements) reduced with avg."""
    return (w * x.sum(), "avg")


def after_idle(call, plain) -> dict:
    """Median cost of one call after the workers sat idle for each gap, two ways:
    ``busy``, the master works during the gap (a loop with other work between
    its calls: only the workers are idle), and ``sleep``, the master sleeps
    too (time.sleep: the whole machine idles, and on a VM the master's own
    wake-up is slow). Each next to the plain PyTensor call after the same gap.

    The two series run one after the other, not interleaved: a plain call
    and its gap between two synkhronos calls would leave the workers idle
    for twice the gap (an earlier version of this benchmark did)."""
    out = {}
    reps = 40 if QUICK else 200
    for how, wait in (("busy", bl.busy), ("sleep", time.sleep)):
        for gap in bl.IDLE_GAPS:
            synk_t, plain_t = _after_gaps(call, wait, gap, reps), _after_gaps(plain, wait, gap, reps)
            out[bl.gap_key(gap, how)] = {"synk": bl.summarize(synk_t), "plain": bl.summarize(plain_t)}
    return out


def _after_gaps(call, wait, gap: float, reps: int) -> list:
    """Seconds of each of ``reps`` calls, each after ``wait(gap)``."""
    times = []
    for _ in range(reps):
        wait(gap)
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _worker_cpu_seconds() -> float:
    """User + system CPU seconds used so far by the workers of this fork."""
    total = 0
    for pid in synk._runtime.running_session().watch.pids.values():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(call) -> dict:
    """CPU seconds the workers use per second of wall time (summed over workers):
    while a loop calls every 5 ms, and while the fork sits idle."""
    span = 0.5 if QUICK else 2.0
    out = {}
    for name, gap in (("loop, a call every 5 ms", 5e-3), ("idle", None)):
        call()
        cpu0, t0 = _worker_cpu_seconds(), time.perf_counter()
        while time.perf_counter() - t0 < span:
            if gap is None:
                time.sleep(span)
            else:
                call()
                time.sleep(gap)
        wall = time.perf_counter() - t0
        out[name] = (_worker_cpu_seconds() - cpu0) / wall
    out["workers"] = len(synk._runtime.running_session().watch.pids)
    return out


def scatter() -> dict:
    """Inputs in synk.data vs numpy inputs, at a small and a large size (row 0 read only)."""
    X = pt.fmatrix("X")
    g = synk.function([X], X[0, 0], name="scatter_probe")
    synk.distribute()
    out = {}
    for nbytes in ((64 << 10), (4 << 20) if QUICK else (64 << 20)):
        arr = np.ones((nbytes // 4096, 1024), np.float32)
        d = synk.data(arr)
        kw = dict(warmup=5, max_reps=TINY_REPS, budget_s=BUDGET, warmup_s=0.05 if QUICK else 0.3)  # as overhead()
        p = bl.measure(lambda: g.as_pytensor(arr), **kw)
        sd = bl.measure(lambda: g(d), **kw)
        sn = bl.measure(lambda: g(arr), **kw)
        out[bl.label(nbytes)] = {"bytes": nbytes, "pytensor_call": p, "synk_data": sd, "synk_numpy": sn,
                                 "data_overhead_us": us(sd) - us(p), "numpy_overhead_us": us(sn) - us(p)}
        d.free_memory()
    return out


def reduce_outputs() -> dict:
    """A 4 MiB output reduced with each op (call minus the plain PyTensor call)."""
    W = pytensor.shared(np.ones(1 << 20, np.float32), name="W_out")
    x = pt.fvector("x")
    fns = {str(op): synk.function([x], (W * x.sum(), op), name=f"out_{op}")
           for op in ("avg", "sum", "gather", None)}
    synk.distribute()
    xd = synk.data(np.ones(2, np.float32))
    res = {"output_bytes": 4 << 20}
    kw = dict(warmup=3, max_reps=500, budget_s=BUDGET)
    p = bl.measure(lambda: fns["avg"].as_pytensor(xd), **kw)
    res["pytensor_call"] = p
    for op, fn in fns.items():
        s = bl.measure(lambda: fn(xd), **kw)
        res[op] = {"call": s, "overhead_us": us(s) - us(p)}
    xd.free_memory()
    return res


# ---------------------------------------------------------------------------
# shared-variable collectives


def collectives() -> dict:
    sizes = bl.sizes_for(QUICK)
    shareds = {n: pytensor.shared(np.zeros(n // 4, np.float32), name=f"v{bl.label(n)}") for n in sizes}
    synk.function([], [v.sum() for v in shareds.values()], name="collective_holder")
    synk.distribute()
    ops = {
        "all_reduce": lambda v: synk.all_reduce(v, op="sum"),
        "all_reduce_avg": lambda v: synk.all_reduce(v, op="avg"),
        "broadcast": lambda v: synk.broadcast(v),
        "gather": lambda v: synk.gather(v),
        "reduce": lambda v: synk.reduce(v, op="sum", in_place=False),
    }
    out = {name: {} for name in ops}
    for n, v in shareds.items():
        reps = bl.reps_for(n, QUICK)
        # 2000 calls of a few microseconds last a few milliseconds: without a
        # warm-up of some length, one hiccup of the VM (or the ramp after the
        # distribute() above) moves the median of a small size by half
        warm_s = 0.0 if n > 64 << 10 else (0.02 if QUICK else 0.1)
        for name, op in ops.items():
            out[name][bl.label(n)] = bl.measure(lambda: op(v), warmup=3, min_reps=min(5, reps),
                                                max_reps=reps, budget_s=BUDGET, warmup_s=warm_s)
    return out


def versions() -> dict:
    return {"synkhronos": synk.__version__, "pytensor": pytensor.__version__, "numpy": np.__version__,
            "pytensor_linker": str(pytensor.config.linker), "pytensor_mode": str(pytensor.config.mode)}


def main() -> None:
    result = {"n_parallel": args.n, "versions": versions()}
    try:
        if args.part == "first":
            t0 = time.perf_counter()
            f, _ = build_mlp()
            build = time.perf_counter() - t0
            result["first_call"] = dict(first_call(f), master_build_s=build)
        elif args.part == "main":
            result["overhead"] = overhead()
            result["scatter"] = scatter()
            result["reduce_outputs"] = reduce_outputs()
            result["collectives"] = collectives()
        else:
            f, params = build_mlp()
            f.as_pytensor(*batch_data(64))
            synk.distribute()
            result["train"] = train(f, params)
    finally:
        synk.close()
    bl.write_part(args.json, result)


main()
sys.exit(0)
