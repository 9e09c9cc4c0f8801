"""Turn the parts' results into the table of ratios, the targets of issue 6, and plots."""

from __future__ import annotations

import math

__all__ = ["collective_rows", "targets", "targets_18", "targets_48", "fakegpu_lines", "format_report", "plot"]

PEERS = (("synk", "synkhronos"), ("mpi", "Open MPI"), ("gloo", "torch gloo"))
OPS = ("all_reduce", "broadcast", "gather", "reduce")


def _get(d, *keys):
    """d[k0][k1]...; None where any level is missing."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _med(d, *keys):
    v = _get(d, *keys)
    return v.get("median") if isinstance(v, dict) else None


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_time(s) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_ratio(r) -> str:
    return "—" if r is None else f"{r:.2f}×"


def _synk_collectives(parts):
    return _get(parts, "synk", "collectives") or {}


def _sizes(parts):
    """Size labels measured, small to large, in the order the parts wrote them."""
    for src in (_synk_collectives(parts).get("all_reduce"), _get(parts, "mpi", "all_reduce"),
                _get(parts, "local", "numpy_copy")):
        if isinstance(src, dict) and src:
            return list(src)
    return []


def collective_rows(parts) -> list[dict]:
    """One row per (op, size): each library's median and synk's ratio to each."""
    rows = []
    synk = _synk_collectives(parts)
    for op in OPS:
        for size in _sizes(parts):
            row = {"op": op, "size": size,
                   "synk": _med(synk, op, size),
                   "mpi": _med(parts, "mpi", op, size),
                   "gloo": _med(parts, "gloo", op, size),
                   "numpy_copy": _med(parts, "local", "numpy_copy", size)}
            row["synk_over_mpi"] = _ratio(row["synk"], row["mpi"])
            row["synk_over_gloo"] = _ratio(row["synk"], row["gloo"])
            row["synk_over_copy"] = _ratio(row["synk"], row["numpy_copy"])
            rows.append(row)
    return rows


def training_rows(parts) -> list[dict]:
    configs = [("2 processes", _get(parts, "synk_train_2", "train")),
               ("1 process, 1 core", _get(parts, "synk_train_1", "train")),
               ("1 process, all cores", _get(parts, "synk_train_1_threads", "train"))]
    batches = []
    for _, t in configs:
        for b in (t or {}).get("batches", {}):
            if b not in batches:
                batches.append(b)
    rows = []
    for b in sorted(batches, key=int):
        row = {"batch": int(b)}
        for name, t in configs:
            row[name] = _get(t, "batches", b, "samples_per_s")
        row["speedup_2_vs_1core"] = _ratio(row["2 processes"], row["1 process, 1 core"])
        row["speedup_2_vs_1allcores"] = _ratio(row["2 processes"], row["1 process, all cores"])
        rows.append(row)
    return rows


def _target(name, value, ratio, limit, met, note="") -> dict:
    return {"target": name, "value": value, "ratio": ratio, "limit": limit,
            "met": met, "status": "n/a" if met is None else ("MET" if met else "NOT MET"), "note": note}


def targets(parts) -> list[dict]:
    """The targets of issue 6, each with its measured ratio and whether it is met."""
    out = []
    ov = _get(parts, "synk", "overhead") or {}
    over = ov.get("overhead_us")
    pool = _med(parts, "local", "pool_map")
    pool_us = None if pool is None else pool * 1e6
    r_abs = _ratio(over, 50.0)
    r_pool = _ratio(over, pool_us)
    met = None if over is None else (over <= 50.0 and (r_pool is None or r_pool <= 0.2))
    out.append(_target("per-call overhead of a tiny function, 2 processes: ≤ 50 µs and ≥ 5× better than Pool",
                       over, r_abs, "≤ 1 (of 50 µs), Pool ratio ≤ 0.2", met,
                       f"{over:.1f} µs; Pool.map {fmt_time(pool)} → ratio to Pool {fmt_ratio(r_pool)}"
                       if over is not None else "synk part missing"))

    sizes = _sizes(parts)
    big = sizes[-1] if sizes else "64MiB"
    synk = _synk_collectives(parts)
    ar = _med(synk, "all_reduce", big)
    ar_mpi = _med(parts, "mpi", "all_reduce", big)
    ar_copy = _med(parts, "local", "numpy_copy", big)
    r = _ratio(ar, ar_mpi)
    out.append(_target(f"all_reduce {big}: ≤ 0.5 × Open MPI", ar, r, "≤ 0.5",
                       None if r is None else r <= 0.5, f"synk {fmt_time(ar)} vs MPI {fmt_time(ar_mpi)}"))
    r = _ratio(ar, ar_copy)
    out.append(_target(f"all_reduce {big}: ≤ 2 × numpy copy", ar, r, "≤ 2",
                       None if r is None else r <= 2.0, f"synk {fmt_time(ar)} vs copy {fmt_time(ar_copy)}"))
    for op in ("broadcast", "gather"):
        s, m = _med(synk, op, big), _med(parts, "mpi", op, big)
        r = _ratio(s, m)
        out.append(_target(f"{op} {big}: no slower than Open MPI", s, r, "≤ 1",
                           None if r is None else r <= 1.0, f"synk {fmt_time(s)} vs MPI {fmt_time(m)}"))

    tr = training_rows(parts)
    sp = tr[-1]["speedup_2_vs_1core"] if tr else None
    out.append(_target(f"training step, 2 workers vs 1 (one core) at batch {tr[-1]['batch'] if tr else '?'}: "
                       "≥ 1.8× throughput", sp, sp, "≥ 1.8", None if sp is None else sp >= 1.8,
                       "" if not tr else f"2 proc {tr[-1]['2 processes'] or 0:.0f}/s vs 1 proc "
                                         f"{tr[-1]['1 process, 1 core'] or 0:.0f}/s"))

    fc = _get(parts, "synk_first", "first_call") or {}
    w, m = fc.get("workers_first_call_s"), fc.get("master_first_call_s")
    r = _ratio(w, m)
    ready = _ratio(None if w is None else w + fc.get("distribute_s", 0.0),
                   None if m is None else m + fc.get("master_build_s", 0.0))
    out.append(_target("first call after distribute() (workers) ≤ the master's own first call", w, r, "≤ 1",
                       None if r is None else r <= 1.0,
                       f"workers {fmt_time(w)} vs master {fmt_time(m)}; with distribute() vs with "
                       f"function(): {fmt_ratio(ready)}" if r is not None else "synk part missing"))
    return out


def targets_18(parts) -> list[dict]:
    """The goals of issue 18 (microsecond calls), each with its ratio and whether it is met."""
    out = []
    ov = _get(parts, "synk", "overhead") or {}
    for key, what in (("overhead_us", "numpy input"), ("overhead_data_us", "synk.data input")):
        v = ov.get(key)
        out.append(_target(f"per-call overhead over the plain PyTensor call, tight loop, {what}: ≤ 15 µs",
                           v, _ratio(v, 15.0), "≤ 1 (of 15 µs)", None if v is None else v <= 15.0,
                           "" if v is None else f"{v:.1f} µs"))
    bd = ov.get("breakdown_us") or {}
    for key, what in (("+ avg reduction of a 0-d output", "0-d"),
                      ("avg reduction of a 4 KiB output (vs none)", "4 KiB")):
        v = bd.get(key)
        out.append(_target(f"reducing a small output ({what}) adds ≤ 5 µs", v, _ratio(v, 5.0),
                           "≤ 1 (of 5 µs)", None if v is None else v <= 5.0,
                           "" if v is None else f"{v:.1f} µs"))
    synk = _synk_collectives(parts)
    for op in ("all_reduce", "broadcast"):
        s, m = _med(synk, op, "4B"), _med(parts, "mpi", op, "4B")
        r = _ratio(s, m)
        out.append(_target(f"{op} of a 4-byte shared variable: ≤ 2 × Open MPI", s, r, "≤ 2",
                           None if r is None else r <= 2.0, f"synk {fmt_time(s)} vs MPI {fmt_time(m)}"))
    tight = _med(ov, "synk_call_numpy")
    for gap, got in (ov.get("after_idle") or {}).items():
        s, p = _med(got, "synk"), _med(got, "plain")
        r = _ratio(s, tight)
        busy = gap.endswith("busy")  # the goal: the workers sat idle, the master worked
        what = (f"a call after the workers sat idle {gap.split()[0]} (the master busy): ≤ 2 × the tight-loop call"
                if busy else f"a call after {gap} of time.sleep in the master (VM wake-up; reported, no goal)")
        out.append(_target(what, s, r, "≤ 2" if busy else "—", (None if r is None else r <= 2.0) if busy else None,
                           f"{fmt_time(s)} vs {fmt_time(tight)} in a loop; the plain PyTensor call after "
                           f"the same gap: {fmt_time(p)} ({fmt_ratio(_ratio(p, _med(ov, 'pytensor_call')))} "
                           "its own tight loop)" + _floor_after(parts, gap)))
    for size in ("4MiB", "64MiB"):
        s, m = _med(synk, "all_reduce", size), _med(parts, "mpi", "all_reduce", size)
        r = _ratio(s, m)
        out.append(_target(f"no regression: all_reduce {size} ≤ 0.5 × Open MPI", s, r,
                           "≤ 0.5", None if r is None else r <= 0.5, f"synk {fmt_time(s)} vs MPI {fmt_time(m)}"))
    cpu = ov.get("idle_cpu") or {}
    if cpu:
        out.append(_target("CPU used by idle workers (reported, no goal)", None, None, "—", None,
                           "; ".join(f"{k}: {v:.2f} CPU-s per s" for k, v in cpu.items() if k != "workers")
                           + f" ({cpu.get('workers')} worker{'' if cpu.get('workers') == 1 else 's'}, "
                             "idle_spin=0.02 s)"))
    return out


def targets_48(parts) -> list[dict]:
    """Issue 48's target measured on the CuPy stand-in (bench/fakegpu_bench.py, part fakegpu)."""
    t = _get(parts, "fakegpu", "target")
    name = "stand-in: synk.all_reduce 4 B ≤ 2× the stand-in's allReduce (issue 48)"
    if not t:
        return [_target(name, None, None, "≤ 2", None, "fakegpu part missing")]
    rows = parts["fakegpu"]["rows"]
    return [_target(name, rows["synk.all_reduce 4 B"]["best_s"], t["ratio"], "≤ 2", t["ratio"] <= 2.0,
                    f"synk {fmt_time(rows['synk.all_reduce 4 B']['best_s'])} vs stand-in allReduce "
                    f"{fmt_time(rows['stand-in allReduce 4 B']['best_s'])} (best of {parts['fakegpu']['rounds']} "
                    f"rounds of {parts['fakegpu']['reps']})")]


def fakegpu_lines(res) -> list[str]:
    """bench/fakegpu_bench.py's table: its rows, the per-call overheads, the target."""
    out = [f"Stand-in GPU (tests/fakegpu CuPy, JAX on the CPU), 1 process: best of {res['rounds']} rounds "
           f"of {res['reps']} calls; {res['cores']} cores, {res['cpu']}, load {res['loadavg'][0]:.2f}"]
    rows = [[label, fmt_time(r["best_s"]), fmt_time(sorted(r["rounds_s"])[len(r["rounds_s"]) // 2])]
            for label, r in res["rows"].items()]
    rows += [[f"overhead, {k}", fmt_time(v), ""] for k, v in res["overhead_s"].items()]
    out += _table(["what", "best", "median round"], rows)
    t = res["target"]
    out.append(f"  [{t['status']:>7}] {t['target']}: ratio {t['ratio']:.3g} (want ≤ {t['limit']:g})")
    if res.get("all_reduce_route"):
        out.append(f"  synk.all_reduce 4 B went through: {res['all_reduce_route']}")
    return out


def _floor_after(parts, gap: str) -> str:
    """The Python floor's round trip after ``gap`` (a busy master), as the after-idle goals quote it."""
    f, tight = _med(parts, "local", "python_floor_after_busy", gap), _med(parts, "local", "python_floor_all_reduce")
    if f is None:
        return ""
    return (f"; the Python floor (a bare shared-memory round trip) after the same gap: {fmt_time(f)} "
            f"({fmt_ratio(_ratio(f, tight))} its own tight loop)")


# ---------------------------------------------------------------------------
# text


def _table(header, rows) -> list[str]:
    if not rows:
        return ["  (nothing measured)"]
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def format_report(result) -> str:
    parts = result["parts"]
    out = []
    meta = result["meta"]
    foreign = meta.get("foreign_cpu_share")
    out.append(f"synkhronos benchmark — {meta['when']}  ({'quick' if meta['quick'] else 'full'} run, "
               f"{meta['cores']} cores, {meta['cpu']})")
    out.append(f"  quiet? CPUs {meta['cpu_busy_before']:.0%} busy before; other programs used "
               f"{'?' if foreign is None else f'{foreign:.0%}'} of the CPUs during the run; "
               f"load average {meta['loadavg_before'][0]:.2f} → {meta['loadavg_after'][0]:.2f}")
    for name, part in parts.items():
        share = part.get("foreign_cpu_share")
        if share is not None and share > 0.1 + part.get("free_cores_share", 0.0):
            out.append(f"  {name}: other programs used {share:.0%} of the CPUs meanwhile: noisy")
        if "skipped" in part:
            out.append(f"  {name}: skipped — {part['skipped']}")
        elif "error" in part:
            out.append(f"  {name}: FAILED — {part['error'].strip().splitlines()[-1] if part['error'].strip() else '?'}")
    out.append("")
    out.append("Collectives, 2 processes, float32 (median; slowest rank for MPI/gloo; synk = master's call)")
    rows = [[r["op"], r["size"], fmt_time(r["synk"]), fmt_time(r["mpi"]), fmt_time(r["gloo"]),
             fmt_time(r["numpy_copy"]), fmt_ratio(r["synk_over_mpi"]), fmt_ratio(r["synk_over_gloo"]),
             fmt_ratio(r["synk_over_copy"])] for r in result["collectives"]]
    out += _table(["op", "size", "synk", "Open MPI", "gloo", "numpy copy", "synk/MPI", "synk/gloo",
                   "synk/copy"], rows)
    avg = _get(parts, "synk", "collectives", "all_reduce_avg")
    if avg:
        out.append("  synk all_reduce op=avg: " + ", ".join(f"{k} {fmt_time(v['median'])}" for k, v in avg.items()))

    out.append("")
    out.append("Per call")
    ov = _get(parts, "synk", "overhead") or {}
    rows = []
    if ov:
        rows.append(["synk tiny function, numpy input (call)", fmt_time(_med(ov, "synk_call_numpy"))])
        rows.append(["plain PyTensor call of the same graph", fmt_time(_med(ov, "pytensor_call"))])
        rows.append(["synk per-call overhead (difference)", fmt_time(ov["overhead_us"] * 1e-6)])
        rows.append(["synk overhead with a synk.data input", fmt_time(ov["overhead_data_us"] * 1e-6)])
        for k, v in ov["breakdown_us"].items():
            rows.append([f"  {k}", fmt_time(v * 1e-6)])
    for label_, keys in (("multiprocessing.Pool(2).map, 2 trivial tasks", ("local", "pool_map")),
                         ("POSIX semaphore round trip (sleeping partner)", ("local", "semaphore_round_trip")),
                         ("POSIX semaphore round trip (spinning partner)", ("local", "semaphore_round_trip_spin")),
                         ("Python floor of a 4 B all-reduce (spinning, no checks)",
                          ("local", "python_floor_all_reduce")),
                         ("Open MPI barrier", ("mpi", "barrier")),
                         ("Open MPI all-reduce 4 B", ("mpi", "all_reduce", "4B")),
                         ("gloo barrier", ("gloo", "barrier")),
                         ("gloo all-reduce 4 B", ("gloo", "all_reduce", "4B"))):
        rows.append([label_, fmt_time(_med(parts, *keys))])
    out += _table(["what", "median"], rows)

    sc = _get(parts, "synk", "scatter")
    if sc:
        out.append("")
        out.append("Scatter (call minus plain PyTensor call; the function reads one element)")
        out += _table(["input size", "synk.data input", "numpy input"],
                      [[k, fmt_time(v["data_overhead_us"] * 1e-6), fmt_time(v["numpy_overhead_us"] * 1e-6)]
                       for k, v in sc.items()])
    ro = _get(parts, "synk", "reduce_outputs")
    if ro:
        out.append("")
        out.append(f"Output reductions of a {ro['output_bytes'] >> 20} MiB output (call minus plain PyTensor "
                   f"call {fmt_time(_med(ro, 'pytensor_call'))})")
        out += _table(["op", "overhead"], [[op, fmt_time(ro[op]["overhead_us"] * 1e-6)]
                                           for op in ("avg", "sum", "gather", "None") if op in ro])

    tr = result["training"]
    if tr:
        t = _get(parts, "synk_train_2", "train") or {}
        out.append("")
        out.append(f"Training step ({t.get('model', 'MLP')}, call + all_reduce of "
                   f"{(t.get('param_bytes') or 0) / 1024:.0f} KiB of parameters), samples/s; "
                   f"the all_reduce alone takes {fmt_time(_med(t, 'param_all_reduce'))} with 2 processes")
        cols = ["2 processes", "1 process, 1 core", "1 process, all cores"]
        out += _table(["batch"] + cols + ["2 vs 1 core", "2 vs all cores"],
                      [[r["batch"]] + [("—" if r[c] is None else f"{r[c]:.0f}") for c in cols]
                       + [fmt_ratio(r["speedup_2_vs_1core"]), fmt_ratio(r["speedup_2_vs_1allcores"])]
                       for r in tr])

    fc = _get(parts, "synk_first", "first_call")
    if fc:
        out.append("")
        out.append(f"First call (compile cache: {result['meta'].get('compile_cache')})")
        out += _table(["what", "seconds"], [
            ["master: synk.function() (build + compile)", fmt_time(fc["master_build_s"])],
            ["master: first call (as_pytensor)", fmt_time(fc["master_first_call_s"])],
            ["master: second call", fmt_time(fc["master_second_call_s"])],
            ["distribute()", fmt_time(fc["distribute_s"])],
            ["first distributed call (workers' first)", fmt_time(fc["workers_first_call_s"])],
            ["later distributed calls", fmt_time(fc["distributed_steady_call_s"])]])

    fg = parts.get("fakegpu")
    if fg and "rows" in fg:
        out.append("")
        out += fakegpu_lines(fg)

    for title, key in (("Targets", "targets"), ("Goals (microsecond calls)", "targets_18"),
                       ("Issue 48 (stand-in GPU)", "targets_48")):
        out.append("")
        out.append(title + (" (quick run: smoke only, not a measurement)" if meta["quick"] else ""))
        for t in result.get(key, []):
            ratio = "—" if t["ratio"] is None else f"{t['ratio']:.3g}"
            out.append(f"  [{t['status']:>7}] {t['target']}: ratio {ratio} (want {t['limit']}); {t['note']}")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# plots


def _stamp(fig, machine: str) -> None:
    from benchlib import stamp

    stamp(fig, machine)


def plot(result, outdir) -> list[str]:
    """Draw the PNGs under ``outdir``; returns their paths (empty without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchlib import SIZES, label

    bytes_of = {label(n): n for n in SIZES}
    meta = result.get("meta", {})
    machine = f"{meta.get('cpu', '?')}, {meta.get('cores', '?')} cores, {str(meta.get('when', '?'))[:10]}"
    paths = []
    rows = result["collectives"]
    if any(r[k] for r in rows for k in ("synk", "mpi", "gloo", "numpy_copy")):
        paths.append(_plot_collectives(plt, rows, bytes_of, outdir, machine))
    tr = result["training"]
    if tr:
        paths.append(_plot_training(plt, tr, outdir, machine))
    parts = result["parts"]
    bars = [("synk overhead", _get(parts, "synk", "overhead", "overhead_us")),
            ("Pool.map", _med(parts, "local", "pool_map")),
            ("semaphore RTT", _med(parts, "local", "semaphore_round_trip")),
            ("MPI barrier", _med(parts, "mpi", "barrier")),
            ("MPI all-reduce 4 B", _med(parts, "mpi", "all_reduce", "4B")),
            ("gloo barrier", _med(parts, "gloo", "barrier")),
            ("gloo all-reduce 4 B", _med(parts, "gloo", "all_reduce", "4B"))]
    bars = [(n, (v * 1e-6 if n == "synk overhead" else v)) for n, v in bars if v is not None]
    if bars:
        paths.append(_plot_per_call(plt, bars, outdir, machine))
    return paths


def _plot_collectives(plt, rows, bytes_of, outdir, machine: str) -> str:
    fig, axes = plt.subplots(1, len(OPS), figsize=(5 * len(OPS), 4.5), sharey=True)
    for ax, op in zip(axes, OPS):
        for key, name, style in (("synk", "synkhronos", "o-"), ("mpi", "Open MPI (sm)", "s-"),
                                 ("gloo", "torch gloo", "^-"), ("numpy_copy", "numpy copy (floor)", "k--")):
            pts = [(bytes_of.get(r["size"]), r[key]) for r in rows if r["op"] == op and r[key]]
            pts = [p for p in pts if p[0]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op}, 2 processes")
        ax.set_xlabel("bytes per process")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds (median)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend()
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _stamp(fig, machine)
    path = f"{outdir}/collectives.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_training(plt, tr, outdir, machine: str) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, style in (("2 processes", "o-"), ("1 process, 1 core", "s-"), ("1 process, all cores", "^--")):
        pts = [(r["batch"], r[name]) for r in tr if r.get(name)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples / s")
    ax.set_title("MLP training step (call + all_reduce of parameters)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _stamp(fig, machine)
    path = f"{outdir}/training.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_per_call(plt, bars, outdir, machine: str) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.barh([b[0] for b in bars], [b[1] * 1e6 for b in bars])
    ax.set_xscale("log")
    ax.set_xlabel("µs per call (median)")
    ax.set_title("Per-call cost, 2 processes")
    ax.axvline(15, color="r", ls="--", lw=1, label="goal: 15 µs")
    ax.legend()
    ax.invert_yaxis()
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _stamp(fig, machine)
    path = f"{outdir}/per_call.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
