"""A PyMC model data-parallel: Bayesian logistic regression on every core, checked against PyMC.

The data are made here (no download). The script builds the model once with PyMC, makes its
data-parallel copy with ``synkhronos.pymc.data_parallel``, checks that the log-density and its
gradient equal PyMC's, then runs ``find_MAP``, ADVI and NUTS on the copy exactly as on any PyMC
model, and draws from the posterior predictive. The exit status is 1 if a check fails.

Usage: ``python demos/pymc_logistic.py [--rows N] [--processes N] [--draws N] [--advi-steps N]``
(needs ``pip install 'synkhronos[pymc]'``).
"""

import argparse
import os
import sys
import time
import warnings

# one XLA thread per process, before JAX starts (synkhronos sets it in the workers itself)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import numpy as np  # noqa: E402

import synkhronos as synk  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", type=int, default=50_000)
parser.add_argument("--processes", type=int, default=None, help="default: one per core")
parser.add_argument("--draws", type=int, default=300)
parser.add_argument("--advi-steps", type=int, default=2000)
args = parser.parse_args()

n = synk.fork(args.processes)  # first: the workers start here; PyMC (and JAX) come after
import pymc as pm  # noqa: E402

import synkhronos.pymc as spm  # noqa: E402

rng = np.random.default_rng(0)
K = 10
X = rng.standard_normal((args.rows, K))
true_b = rng.standard_normal(K) * 0.5
y = (rng.random(args.rows) < 1 / (1 + np.exp(-(0.3 + X @ true_b)))).astype("int64")

with pm.Model() as model:
    Xd = pm.Data("X", X)
    a = pm.Normal("a", 0, 2)
    b = pm.Normal("b", 0, 1, shape=K)
    pm.Bernoulli("y", logit_p=a + Xd @ b, observed=y)

t0 = time.perf_counter()
dp = spm.data_parallel(model)  # the rows of X and y go into shared memory once
print(f"synkhronos: {n} processes, {args.rows} rows; data-parallel model built in "
      f"{time.perf_counter() - t0:.1f} s")

ok = True
point = {"a": np.array(0.1), "b": rng.normal(0, 0.3, K)}
ref, got = model.compile_logp()(point), dp.compile_logp()(point)
ref_g, got_g = model.compile_dlogp()(point), dp.compile_dlogp()(point)
same = np.isclose(got, ref, rtol=1e-10) and np.allclose(got_g, ref_g, rtol=1e-10, atol=1e-10 * abs(ref_g).max())
ok &= bool(same)
print(f"log-density {got:.6f} (PyMC {ref:.6f}); gradient equal: {same}")

with dp:
    t0 = time.perf_counter()
    # PyMC 6's own notices of find_MAP's coming defaults (an InferenceData, a jittered start):
    # this demo reads the dict of today's default
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`find_MAP` will", category=FutureWarning)
        map_ = pm.find_MAP(progressbar=False)
    print(f"find_MAP: {time.perf_counter() - t0:.2f} s; b = {np.round(map_['b'], 2)}")
    t0 = time.perf_counter()
    approx = pm.fit(args.advi_steps, method="advi", random_seed=1, progressbar=False)
    print(f"ADVI {args.advi_steps} steps: {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    idata = pm.sample(args.draws, tune=args.draws, chains=1, random_seed=1, progressbar=False,
                      compute_convergence_checks=False)
    print(f"NUTS 1 chain, {args.draws} tune + {args.draws} draws: {time.perf_counter() - t0:.1f} s")
    pp = pm.sample_posterior_predictive(idata, progressbar=False, random_seed=2)

post = idata.posterior["b"].values.reshape(-1, K)
close = np.abs(post.mean(axis=0) - map_["b"]) < 4 * post.std(axis=0) + 1e-3
ok &= bool(close.all())
print(f"posterior mean b = {np.round(post.mean(axis=0), 2)} (within Monte Carlo error of the MAP: {close.all()})")
share = pp.posterior_predictive["y"].values.mean()
print(f"posterior predictive: mean of y {share:.3f} (data {y.mean():.3f})")
ok &= abs(share - y.mean()) < 0.02

print("All PyMC checks passed." if ok else "A PyMC check FAILED.")
synk.close()
sys.exit(0 if ok else 1)
