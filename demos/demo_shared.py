"""Shared variables and the collectives that move and combine their copies.

Every process holds its own copy of each PyTensor shared variable used by a
distributed function (copied from the master at ``distribute()``). Function
calls update those copies locally; nothing is combined unless you call a
collective: ``scatter``, ``broadcast``, ``gather``, ``all_gather``,
``reduce``, ``all_reduce``, ``set_value``, ``get_value``, ``get_lengths``,
``get_shapes``. Each step is checked; the exit status is 1 if a check fails.

Usage: ``python demos/demo_shared.py [n_parallel]`` (needs 2 or more processes
to be interesting; default: one per core, at least 2).
"""

import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else max(2, len(os.sched_getaffinity(0))))
print(f"synkhronos: {n} processes")

failures = []


def check(label, ok):
    print(f"  {'ok  ' if ok else 'FAIL'} {label}")
    if not ok:
        failures.append(label)


s_x = pytensor.shared(np.ones((100, 4)), name="s_x")    # data rows: sliceable
s_y = pytensor.shared(np.zeros((4, 5)), name="s_y")     # weights: the same everywhere
s_unused = pytensor.shared(np.zeros(3), name="s_unused")  # in no synk function: workers lack it
z = pt.mean(s_x.dot(s_y), axis=0)
f = synk.function([], z, sliceable_shareds=[s_x])
synk.distribute()  # the workers get s_x and s_y, with their current values

print(f"\nlengths of s_x in each process: {synk.get_lengths(s_x).tolist()}")

rng = np.random.default_rng(3)
x_dat = rng.standard_normal((8 * n, 4))
y_dat = rng.standard_normal((4, 5))
synk.scatter(s_x, x_dat)      # each process gets its share of the rows
synk.broadcast(s_y, y_dat)    # every process gets the whole value (set in the master too)
print(f"after scatter:   shapes of s_x: {synk.get_shapes(s_x)}")

print("\nscatter, then gather:")
check("gather(s_x, nd_up=0) concatenates the parts back", np.allclose(synk.gather(s_x, nd_up=0), x_dat))
check("gather(s_y) stacks n equal copies", np.allclose(synk.gather(s_y), np.stack([y_dat] * n)))

print("\na function of shared variables only (no inputs):")
want = np.mean(x_dat.dot(y_dat), axis=0)
check("f() averages over all the rows", np.allclose(f(), want))
check("f(num_slices=2) too", np.allclose(f(num_slices=2), want))

print("\nreduce and all_reduce:")
parts = synk.gather(s_x, nd_up=0)
total = synk.reduce(s_y, op="sum", in_place=False)
check("reduce(s_y, op='sum', in_place=False) returns n * y", np.allclose(total, n * y_dat))
check("... and leaves the master's s_y as it was", np.allclose(s_y.get_value(), y_dat))
for rank in range(n):
    synk.set_value(rank, s_y, y_dat * (rank + 1))   # a different value in each process
synk.all_reduce(s_y, op="avg")
mean_factor = np.mean(np.arange(1, n + 1))
check("set_value per rank, then all_reduce(op='avg'): every copy is the mean",
      all(np.allclose(synk.get_value(r, s_y), y_dat * mean_factor) for r in range(n)))
synk.all_reduce(s_y, op="max")
check("all_reduce(op='max') of equal copies changes nothing",
      np.allclose(synk.get_value(n - 1, s_y), y_dat * mean_factor))

print("\nall_gather:")
synk.all_gather(s_x)   # every process now holds all the rows
check(f"every process holds all {len(x_dat)} rows", synk.get_lengths(s_x).tolist() == [len(x_dat)] * n)
check("in rank order", np.allclose(synk.get_value(n - 1, s_x), parts))

print("\nerrors name the culprit:")
try:
    synk.gather(s_unused)
except ValueError as err:
    print(f"  ValueError: {err}")
try:
    synk.get_value(n, s_x)
except ValueError as err:
    print(f"  ValueError: {err}")

synk.close()
print("\nAll shared-variable checks passed." if not failures else f"\nFAILED: {failures}")
sys.exit(1 if failures else 0)
