"""Output reductions, output subsets and function slicing (``num_slices``).

Each output of a synkhronos function names how the processes' results
combine: ``avg`` (the default, weighted by each process's rows), ``sum``,
``prod``, ``max``, ``min``, ``gather`` (concatenate in rank order) or
``None`` (the master's own result only). ``output_subset`` computes only
some outputs; ``num_slices`` makes every process run its rows in slices and
accumulate, for inputs too big to compute at once. Each result is checked
against plain PyTensor; the exit status is 1 if any check fails.

Usage: ``python demos/demo_reductions.py [n_parallel]``.
"""

import sys

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk

n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(f"synkhronos: {n} processes")

failures = []


def check(label, got, want):
    ok = np.shape(got) == np.shape(want) and np.allclose(got, want)
    print(f"  {'ok  ' if ok else 'FAIL'} {label}")
    if not ok:
        failures.append(label)


x = pt.dmatrix("x")
y = pt.dmatrix("y")
xy = x.dot(y)
f = synk.function(
    [x, y],
    [
        pt.mean(xy, axis=0),               # "avg" by default
        (pt.sum(xy, axis=0), "sum"),
        (pt.prod(1 + 0.01 * xy, axis=0), "prod"),
        (pt.max(xy, axis=0), "max"),
        (pt.min(xy, axis=0), "min"),
        (pt.argmax(xy, axis=1), "gather"),  # one entry per row: gathered in rank order
    ],
    bcast_inputs=[y],
)
g = synk.function([x], (x.shape[0], None))  # None: the master's own result, no reduction
synk.distribute()

rng = np.random.default_rng(1)
x_dat = 0.5 * rng.standard_normal((999, 8))
y_dat = rng.standard_normal((8, 3))
names = ["avg", "sum", "prod", "max", "min", "gather"]

print("\nEvery output op (999 rows split across the processes):")
want = f.as_pytensor(x_dat, y_dat)
got = f(x_dat, y_dat)
for name, a, b in zip(names, got, want):
    check(f"{name:6s} -> shape {np.shape(a)}", a, b)

print(f"\nOutput op None: the master computed {int(g(x_dat))} of the 999 rows itself")

print("\nOutput subset (only outputs 1 and 5 are computed):")
got = f(x_dat, y_dat, output_subset=[1, 5])
check("sum", got[0], want[1])
check("gather", got[1], want[5])

print("\nSlicing: each process accumulates over 4 slices of its rows:")
for name, a, b in zip(names, f(x_dat, y_dat, num_slices=4), want):
    check(f"{name:6s} with num_slices=4", a, b)

synk.close()
print("\nAll reduction checks passed." if not failures else f"\nFAILED: {failures}")
sys.exit(1 if failures else 0)
