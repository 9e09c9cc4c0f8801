"""PyMC data-parallel (synkhronos.pymc) against what a PyMC user picks today.

A regression of 10 features, made here (no download), with one of three likelihoods
(--likelihood): bernoulli (logistic regression, the default), poisson (log link) or studentt
(free nu and sigma). For each row count the
cases run one after another, each in a fresh subprocess, interleaved (row count by row
count), so that the peers share the machine's state of the moment:

  pymc        PyMC alone, its default backend, one chain (nuts_sampler="pymc")
  pymc-2      PyMC cores=2, 2 chains, one BLAS thread per process
  nutpie      nutpie, one chain (and 2 chains: its own threads)
  numpyro     numpyro (JAX, one XLA thread); eval = jax.value_and_grad of PyMC's logp
  synk        synkhronos.pymc on --n processes, its default backend: eval, find_MAP, ADVI,
              NUTS with PyMC's sampler, numpyro and nutpie
  synk-MODE   the same, each process compiling with MODE (NUMBA, JAX, C): eval only

Parts (--what): eval (one log-density and gradient, ms), map (find_MAP, s), advi (--advi-steps
steps, s), nuts (1 chain of --tune + --draws: s and ESS/s, the smallest bulk ESS of the
parameters per second of sampling), nuts2 (2 chains).

    python bench/pymc_bench.py                       # 20k, 200k, 1M rows, every part
    python bench/pymc_bench.py --rows 20000 --what eval,map --quick
    python bench/pymc_bench.py --rows 200000 --what eval --cases numpyro,synk --likelihood poisson

Writes bench/results/pymc.json (pymc-poisson.json, pymc-studentt.json for the other
likelihoods), prints a table and draws bench/results/pymc.png (time against rows, one panel
per part; needs matplotlib; --plot JSON draws it again). Run on an idle machine: the times
are wall times of one run, not medians of many.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
K = 10
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
LIKELIHOODS = ("bernoulli", "poisson", "studentt")
CASES = ("pymc", "pymc-2", "nutpie", "numpyro", "jax-rw", "synk", "synk-NUMBA", "synk-JAX", "synk-C")
#: What each case measures: parts it has no meaning for are left out.
PARTS = {
    "pymc": ("eval", "map", "advi", "nuts"),
    "pymc-2": ("nuts2",),
    "nutpie": ("nuts", "nuts2"),
    "numpyro": ("eval", "nuts", "nuts2"),
    # JAX in one process on PyMC's graph as synkhronos renders each process's share
    # (synkhronos._integrations.xla_rewrites, its XLA flags): what the split alone brings
    "jax-rw": ("eval",),
    "synk": ("eval", "map", "advi", "nuts", "nuts-numpyro", "nuts-nutpie", "nuts2"),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="20000,200000,1000000")
    p.add_argument("--what", default="eval,map,advi,nuts,nuts2")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--n", type=int, default=2, help="synkhronos processes")
    p.add_argument("--likelihood", default="bernoulli", choices=LIKELIHOODS)
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--tune", type=int, default=500)
    p.add_argument("--advi-steps", type=int, default=5000)
    p.add_argument("--quick", action="store_true", help="few draws and steps: a smoke run")
    p.add_argument("--out", default=None, help="default: bench/results/pymc[-LIKELIHOOD].json")
    p.add_argument("--plot", metavar="JSON", help="only draw the plot of a results file (next to it, .png)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # the subprocess's one case
    args = p.parse_args(argv)
    if args.quick:
        args.draws, args.tune, args.advi_steps = 50, 50, 200
    return args


# ---------------------------------------------------------------------------
# one case, in its own process


def make_model(n_rows: int, likelihood: str = "bernoulli"):
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(0)
    X = rng.standard_normal((n_rows, K))
    beta = rng.standard_normal(K) * 0.5
    eta = X @ beta
    with pm.Model() as model:
        Xd = pm.Data("X", X)
        b = pm.Normal("b", 0, 1, shape=K)
        a = pm.Normal("a", 0, 2)
        if likelihood == "bernoulli":
            y = (rng.random(n_rows) < 1 / (1 + np.exp(-eta))).astype("int64")
            pm.Bernoulli("y", logit_p=a + Xd @ b, observed=y)
        elif likelihood == "poisson":
            pm.Poisson("y", pm.math.exp(a + Xd @ (0.3 * b)), observed=rng.poisson(np.exp(0.3 * eta)))
        else:
            nu = pm.Gamma("nu", 2, 0.1)
            sigma = pm.HalfNormal("sigma", 2)
            pm.StudentT("y", nu=nu, mu=a + Xd @ b, sigma=sigma, observed=eta + 0.5 * rng.standard_t(4, n_rows))
    return model


def time_eval(fn, x, min_time=1.0) -> float:
    """Milliseconds per call of ``fn(x)``: the best of 3 rounds after a warm-up."""
    fn(x)
    best = float("inf")
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_time / 3 or reps < 3:
            fn(x)
            reps += 1
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def pymc_eval(model) -> float:
    import numpy as np

    f = model.logp_dlogp_function(ravel_inputs=True)
    f.set_extra_values({})
    size = sum(np.size(v) for v in model.initial_point().values())
    x = np.full(size, 0.05)
    return time_eval(f, x)


def jax_eval(model, rewrite=False) -> float:
    """JAX's value and gradient of the model's log-density, as numpyro computes them;
    ``rewrite``: on the graph rewritten as synkhronos.pymc does each process's share."""
    import jax
    import numpy as np
    from pymc.sampling.jax import get_jaxified_logp

    if rewrite:  # pymc.sampling.jax.get_jaxified_graph, rendered as synkhronos.pymc renders a share
        from pymc.sampling.jax import _replace_shared_variables
        from pytensor.graph.fg import FunctionGraph

        from synkhronos._integrations.xla_rewrites import render_for_xla

        inner = render_for_xla(FunctionGraph(model.value_vars, _replace_shared_variables([model.logp()]),
                                             clone=True))

        def logp(x):
            return inner(*x)[0]
    else:
        logp = get_jaxified_logp(model, negative_logp=False)
    # the gradient with respect to every value variable, as numpyro's NUTS takes it (until
    # 2026-11-27 this took the first only: StudentT's nu and sigma gradients were left out)
    x = [np.full(np.shape(model.initial_point()[v.name]), 0.05) for v in model.value_vars]
    vg = jax.jit(jax.value_and_grad(lambda *x: logp(x), argnums=tuple(range(len(x)))))
    return time_eval(lambda xs: jax.block_until_ready(vg(*xs)), x)


def ess_per_s(idata, seconds: float) -> float:
    import arviz as az

    ess = az.ess(idata)
    values = [float(ess[v].values.min()) for v in ess.data_vars] if hasattr(ess, "data_vars") else \
        [float(min(v.values.min() for v in ess.values()))]
    return min(values) / seconds


def sample(model, args, chains=1, cores=1, sampler="pymc") -> dict:
    import pymc as pm

    kwargs = {"chain_method": "parallel"} if sampler == "numpyro" and chains > 1 else {}
    with model:
        t0 = time.perf_counter()
        idata = pm.sample(args.draws, tune=args.tune, chains=chains, cores=cores, nuts_sampler=sampler,
                          random_seed=1, progressbar=False, compute_convergence_checks=False,
                          nuts_sampler_kwargs=kwargs)
        seconds = time.perf_counter() - t0
    return {"s": seconds, "ess_per_s": ess_per_s(idata, seconds)}


def run_parts(model, args, parts, sampler_parts) -> dict:
    import pymc as pm

    out = {}
    for part in parts:
        if part == "eval":
            out["eval_ms"] = pymc_eval(model)
        elif part == "map":
            with model:
                t0 = time.perf_counter()
                pm.find_MAP(progressbar=False)
                out["map_s"] = time.perf_counter() - t0
        elif part == "advi":
            with model:
                t0 = time.perf_counter()
                pm.fit(args.advi_steps, method="advi", random_seed=1, progressbar=False)
                out["advi_s"] = time.perf_counter() - t0
        elif part in sampler_parts:
            out[part] = sampler_parts[part]()
    return out


def one_case(args) -> dict:
    case, n_rows = args.case, int(args.rows)
    what = set(args.what.split(","))
    if case.startswith("synk"):
        return synk_case(args, case.partition("-")[2] or None, n_rows, what)
    model = make_model(n_rows, args.likelihood)
    parts = [p for p in PARTS[case] if p in what or (p == "nuts2" and "nuts2" in what)]
    samplers = {
        "pymc": {"nuts": lambda: sample(model, args)},
        "pymc-2": {"nuts2": lambda: sample(model, args, chains=2, cores=2)},
        "nutpie": {"nuts": lambda: sample(model, args, sampler="nutpie"),
                   "nuts2": lambda: sample(model, args, chains=2, sampler="nutpie")},
        "numpyro": {"nuts": lambda: sample(model, args, sampler="numpyro"),
                    "nuts2": lambda: sample(model, args, chains=2, sampler="numpyro")},
        "jax-rw": {},
    }[case]
    out = run_parts(model, args, [p for p in parts if p != "eval"], samplers)
    if "eval" in parts:
        out["eval_ms"] = (jax_eval(model) if case == "numpyro" else jax_eval(model, rewrite=True)
                          if case == "jax-rw" else pymc_eval(model))
    return out


def synk_case(args, mode, n_rows: int, what: set) -> dict:
    import synkhronos as synk

    synk.fork(args.n, device="cpu")
    import synkhronos.pymc as spm

    model = make_model(n_rows, args.likelihood)
    t0 = time.perf_counter()
    dp = spm.data_parallel(model, **({} if mode is None else {"mode": {"C": "FAST_RUN"}.get(mode, mode)}))
    out = {"build_s": time.perf_counter() - t0}
    parts = [p for p in PARTS["synk"] if p in what or (p.startswith("nuts-") and "nuts" in what)]
    if mode is not None:  # a backend named: eval only (its speed per process)
        parts = [p for p in parts if p == "eval"]
    samplers = {"nuts": lambda: sample(dp, args),
                "nuts-numpyro": lambda: sample(dp, args, sampler="numpyro"),
                "nuts-nutpie": lambda: sample(dp, args, sampler="nutpie"),
                "nuts2": lambda: sample(dp, args, chains=2)}
    out.update(run_parts(dp, args, parts, samplers))
    synk.close()
    return out


# ---------------------------------------------------------------------------
# the driver


def run_case(case: str, n_rows: int, args) -> dict:
    env = dict(os.environ)
    if case in ("pymc-2", "numpyro", "jax-rw") or case.startswith("synk"):
        env.update(ONE_THREAD)
    if case == "numpyro":  # 2 parallel chains need 2 XLA host devices
        env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
    if case == "jax-rw":  # numpyro's flags and those synkhronos adds for a process of all the cores
        from synkhronos._procs.xla_flags import xla_flags

        env["XLA_FLAGS"] = xla_flags(env["XLA_FLAGS"], os.cpu_count() or 1)
    cmd = [sys.executable, __file__, "--case", case, "--rows", str(n_rows), "--what", args.what,
           "--n", str(args.n), "--likelihood", args.likelihood, "--draws", str(args.draws), "--tune", str(args.tune),
           "--advi-steps", str(args.advi_steps)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail), "wall_s": time.perf_counter() - t0}
    return json.loads(lines[-1])


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} CPUs"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def table(results: dict) -> str:
    cols = ["eval_ms", "map_s", "advi_s", "nuts", "nuts-numpyro", "nuts-nutpie", "nuts2"]
    lines = ["| rows | case | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 2)]
    for n_rows, cases in results.items():
        for case, r in cases.items():
            cells = []
            for c in cols:
                v = r.get(c)
                cells.append("" if v is None else f"{v['s']:.1f} s, {v['ess_per_s']:.1f} ESS/s"
                             if isinstance(v, dict) else f"{v:.3g}")
            if "error" in r:
                cells[-1] = f"error: {r['error'][:80]}"
            lines.append(f"| {n_rows} | {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The plot's panels: (title, the result's key, its unit); a NUTS panel draws wall times.
PANELS = (("one evaluation (logp and gradient)", "eval_ms", "ms"), ("find_MAP", "map_s", "s"),
          ("ADVI", "advi_s", "s"), ("NUTS, 1 chain", "nuts", "s"), ("NUTS, 2 chains", "nuts2", "s"))
#: NUTS through another sampler on the data-parallel model: a line of its own in the 1-chain panel.
SYNK_SAMPLERS = {"nuts-numpyro": "synk + numpyro", "nuts-nutpie": "synk + nutpie"}


def _color(label: str) -> str:
    """One colour per case in every panel: the peers' first, synkhronos's after them."""
    order = ["pymc", "pymc-2", "nutpie", "numpyro", "jax-rw", "synk", *SYNK_SAMPLERS.values(),
             "synk-JAX", "synk-NUMBA", "synk-C"]
    return f"C{order.index(label) % 10}" if label in order else "black"


def plot(results: dict, path: Path) -> Path | None:
    """Time against rows, log-log, one panel per part and one line per case (and per sampler
    on the data-parallel model). None, with a message, where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("[pymc_bench] no plot: matplotlib is not installed (pip install matplotlib)")
        return None
    rows = sorted(results["rows"], key=int)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 4), squeeze=False)
    for ax, (title, key, unit) in zip(axes[0], PANELS):
        lines = {}
        for n_rows in rows:
            for case, r in results["rows"][n_rows].items():
                keys = [(key, case)] + ([(k, name) for k, name in SYNK_SAMPLERS.items()]
                                        if key == "nuts" and case == "synk" else [])
                for k, label in keys:
                    v = r.get(k)
                    if isinstance(v, dict):
                        v = v.get("s")
                    if isinstance(v, (int, float)) and v > 0:
                        lines.setdefault(label, []).append((int(n_rows), v))
        for label, points in sorted(lines.items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=label, color=_color(label),
                    linewidth=2.5 if label.startswith("synk") else 1.2)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("rows")
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"PyMC logistic regression ({K} features): {results.get('cpu', '')}; synkhronos on "
                 f"{results.get('n')} processes; NUTS {results.get('tune')} + {results.get('draws')}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse(argv)
    if args.plot:
        if not Path(args.plot).is_file():
            sys.exit(f"pymc_bench.py: --plot {args.plot!r}: no such results file (bench/results/pymc.json "
                     "is what a run writes)")
        drawn = plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        if drawn:
            print(f"[pymc_bench] plot: {drawn}")
        return 0
    if args.case:
        print(json.dumps(one_case(args)), flush=True)
        return 0
    if args.out is None:
        suffix = "" if args.likelihood == "bernoulli" else f"-{args.likelihood}"
        args.out = str(HERE / "results" / f"pymc{suffix}.json")
    results = {"cpu": cpu_name(), "likelihood": args.likelihood, "n": args.n, "draws": args.draws, "tune": args.tune,
               "advi_steps": args.advi_steps, "rows": {}}
    for n_rows in [int(r) for r in args.rows.split(",")]:
        results["rows"][n_rows] = {}
        for case in args.cases.split(","):
            results["rows"][n_rows][case] = run_case(case, n_rows, args)
            print(n_rows, case, results["rows"][n_rows][case], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{results['cpu']}; {args.likelihood} likelihood; synkhronos on {args.n} processes; NUTS {args.tune} tune + {args.draws} "
          f"draws; ADVI {args.advi_steps} steps\n")
    print(table(results["rows"]))
    drawn = plot(results, Path(args.out).with_suffix(".png"))
    if drawn:
        print(f"\n[pymc_bench] plot: {drawn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
