"""The introductory example, checked: distributed results next to plain PyTensor's.

A function of a scattered input ``x`` (split by rows across the processes)
and a broadcast input ``y`` (whole in every process), with outputs reduced
by different ops. Every result is printed next to what ``as_pytensor``
(plain PyTensor, master only, all the rows) returns, and the script says
whether they agree; the exit status is 1 if any does not.

Usage: ``python demos/demo_intro.py [n_parallel]`` (default: one process per core).
"""

import sys

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk

n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else None)  # workers start here
print(f"synkhronos: {n} processes (the master and {n - 1} forked)")

x = pt.dmatrix("x")
y = pt.dmatrix("y")
xy = x.dot(y)
outputs = [
    (pt.mean(xy, axis=0), "avg"),   # mean over all rows, processes weighted by their rows
    (pt.sum(xy, axis=0), "sum"),
    (pt.max(xy, axis=0), "max"),
    (pt.min(xy, axis=0), "min"),
    (xy, "gather"),                 # every row, concatenated in rank order
]
f = synk.function([x, y], outputs, bcast_inputs=[y])
synk.distribute()  # pickle the functions to the workers (a call would do it too)

rng = np.random.default_rng(0)
x_dat = rng.standard_normal((1001, 10))   # 1001 rows: the split is uneven on purpose
y_dat = rng.standard_normal((10, 5))

results = f(x_dat, y_dat)
expected = f.as_pytensor(x_dat, y_dat)

np.set_printoptions(precision=5, suppress=True, linewidth=100)
all_ok = True
for (var, op), got, want in zip(outputs, results, expected):
    ok = got.shape == want.shape and np.allclose(got, want)
    all_ok &= ok
    shown_got = got if got.ndim == 1 else f"array of shape {got.shape}"
    shown_want = want if want.ndim == 1 else f"array of shape {want.shape}"
    print(f"\n{op!r} output:")
    print(f"  synkhronos:  {shown_got}")
    print(f"  as_pytensor: {shown_want}")
    print(f"  {'agree' if ok else 'DIFFER'}")

synk.close()
print("\nAll results agree with PyTensor." if all_ok else "\nSOME RESULTS DIFFER from PyTensor.")
sys.exit(0 if all_ok else 1)
