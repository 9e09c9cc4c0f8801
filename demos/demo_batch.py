"""Data in shared memory (``synk.data``) and the ``batch`` keyword.

``synk.data`` arrays live in OS shared memory, which every process maps: a
call whose inputs are ``synk.data`` sends only index ranges, and each process
reads its rows in place. ``batch`` (an int, a slice or a list of indices)
picks the rows of a call before they are split across the processes; with
``minibatch=True`` the data holds exactly one batch, refilled between calls.
Every result is checked against plain PyTensor; the exit status is 1 if a
check fails.

Usage: ``python demos/demo_batch.py [n_parallel]``.
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


# --- synk.data: an array in shared memory --------------------------------
print("\nsynk.data basics:")
rng = np.random.default_rng(2)
d = synk.data(rng.standard_normal((5, 4)), name="d")
print(f"  {d!r}: len {len(d)}, shape {d.shape}, dtype {d.dtype}, allocated {d.alloc_size} items")
d[3] = 0                                       # reads and writes like a numpy array
check("item assignment", d[3], np.zeros(4))
d.set_value(rng.standard_normal((2000, 4)), oversize=1.1)   # grows: new shared memory, 10% spare
print(f"  after set_value of 2000 rows (oversize=1.1): shape {d.shape}, allocated {d.alloc_size} items")
d.set_value(rng.standard_normal((2100, 4)))   # fits in the spare room: no new allocation
print(f"  after set_value of 2100 rows: shape {d.shape}, allocated {d.alloc_size} items (unchanged)")
d.set_length(100)                              # shrink the view, keep the allocation
print(f"  after set_length(100): shape {d.shape}, allocated {d.alloc_size} items")
d.free_memory()
print(f"  after free_memory(): shape {d.shape}, allocated {d.alloc_size} items")
try:
    d.set_value(np.ones((3, 4), dtype="complex128"))
except TypeError as err:
    print(f"  a lossy cast is refused: TypeError: {err}")
d.set_value(np.ones((3, 4), dtype="float32"))  # safe casts are silent
check("safe cast float32 -> float64", d.data, np.ones((3, 4)))

# --- batch: rows selected before the split -------------------------------
x = pt.dmatrix("x")
y = pt.dmatrix("y")
f = synk.function([x, y], pt.mean(x.dot(y), axis=0), bcast_inputs=[y])
synk.distribute()

x_dat = 0.01 * rng.standard_normal((1000, 10))
y_dat = rng.standard_normal((10, 5))
x_synk, y_synk = f.build_inputs(x_dat, y_dat)  # copies into new synk.data, one per input

print("\nbatch keyword on synk.data inputs (only indices travel to the workers):")
idx = rng.integers(0, 1000, size=100)
for label, batch in [("batch=100 (first 100 rows)", 100), ("batch=slice(10, 100)", slice(10, 100)),
                     ("batch=slice(100, 1000, 3)", slice(100, 1000, 3)),
                     ("batch=<100 random indices>", idx)]:
    rows = x_dat[:batch] if isinstance(batch, int) else x_dat[batch]
    check(label, f(x_synk, y_synk, batch=batch), f.as_pytensor(rows, y_dat))

print("\nbatch keyword on numpy inputs (the master copies the selected rows):")
check("batch=<100 random indices>", f(x_dat, y_dat, batch=idx), f.as_pytensor(x_dat[idx], y_dat))

print("\nminibatch data: refill one batch in place, call on it:")
mb = synk.data(var=x, minibatch=True, name="minibatch")
for k in range(3):
    sel = rng.permutation(1000)[:64]
    mb.set_value(x_dat[sel])                   # same size every time: no new allocation
    check(f"minibatch {k}", f(mb, y_synk), f.as_pytensor(x_dat[sel], y_dat))

synk.close()
print("\nAll batch checks passed." if not failures else f"\nFAILED: {failures}")
sys.exit(1 if failures else 0)
