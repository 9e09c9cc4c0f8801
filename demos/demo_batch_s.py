"""``batch_s``: select rows of data already scattered into shared variables.

Data that stays in the processes between calls can live in "sliceable"
shared variables (``sliceable_shareds=``): scatter it once, then pick the
rows of each call with ``batch_s``, applied inside each process to its own
copy (unlike ``batch``, which selects rows before scattering). ``batch_s``
is a slice or an index list used by every process, or a list of those with
one per process; ``num_slices`` works on top. Each result is checked against
plain PyTensor on the same rows; the exit status is 1 if a check fails.

Usage: ``python demos/demo_batch_s.py [n_parallel]``.
"""

import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(f"synkhronos: {n} processes")

failures = []


def check(label, got, want):
    ok = np.allclose(got, want)
    print(f"  {'ok  ' if ok else 'FAIL'} {label}")
    if not ok:
        failures.append(label)


ROWS = 200  # rows in each process after the scatter
s_x = pytensor.shared(np.zeros((ROWS, 10)), name="s_x")
s_y = pytensor.shared(np.zeros((10, 5)), name="s_y")
z = pt.sum(s_x.dot(s_y), axis=0)
f = synk.function([], (z, "sum"), sliceable_shareds=[s_x])
synk.distribute()

rng = np.random.default_rng(5)
x_dat = 0.01 * rng.standard_normal((ROWS * n, 10))
y_dat = rng.standard_normal((10, 5))
synk.scatter(s_x, x_dat)     # process r holds rows r*ROWS ... (r+1)*ROWS - 1
synk.broadcast(s_y, y_dat)

x = pt.dmatrix("x")
y = pt.dmatrix("y")
f_plain = pytensor.function([x, y], pt.sum(x.dot(y), axis=0))


def rows(sel, rank):
    """The rows of x_dat that selection ``sel`` picks inside process ``rank``."""
    return x_dat[rank * ROWS:(rank + 1) * ROWS][sel]


slice_1 = slice(100, 200)                                           # same slice everywhere
list_2 = rng.integers(0, ROWS, size=100)                            # same indices everywhere
slices_3 = [slice(i, 100 + 2 * i) for i in range(n)]                # one slice per process
lists_4 = [rng.integers(0, ROWS, size=50 + 10 * i) for i in range(n)]  # one list per process

cases = [
    ("one slice for every process", slice_1, [slice_1] * n),
    ("one index list for every process", list_2, [list_2] * n),
    ("a slice per process (uneven)", slices_3, slices_3),
    ("an index list per process (uneven)", lists_4, lists_4),
]
for label, batch_s, per_rank in cases:
    want = f_plain(np.concatenate([rows(sel, r) for r, sel in enumerate(per_rank)]), y_dat)
    check(label, f(batch_s=batch_s), want)
    check(label + ", num_slices=4", f(batch_s=batch_s, num_slices=4), want)

try:
    f(batch_s=slice(0, ROWS + 1))
except (IndexError, ValueError) as err:
    print(f"\n  beyond a process's rows: {type(err).__name__}: {err}")

synk.close()
print("\nAll batch_s checks passed." if not failures else f"\nFAILED: {failures}")
sys.exit(1 if failures else 0)
