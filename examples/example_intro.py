"""The introductory example: a scattered input, a broadcast input, an averaged output.

Run it with ``python examples/example_intro.py``; it prints what
``examples/example_intro.txt`` holds.
"""

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk

n = synk.fork(n_parallel=2)  # first: the worker is forked here and never returns

x = pt.dmatrix("x")
y = pt.dmatrix("y")
z = pt.mean(x.dot(y), axis=0)
f = synk.function([x, y], z, bcast_inputs=[y])  # x is scattered, y reaches every process whole
synk.distribute()

rng = np.random.default_rng(0)
x_dat = rng.standard_normal((101, 10))  # 101 rows: rank 0 computes 51 of them, rank 1 the other 50
y_dat = rng.standard_normal((10, 4))

r = f(x_dat, y_dat)               # every process computes its rows; "avg" weighs them by rows
r_pt = f.as_pytensor(x_dat, y_dat)  # plain PyTensor in the master, on all the rows

np.set_printoptions(precision=6, suppress=True)
print("processes:", n)
print("synkhronos: ", r)
print("as_pytensor:", r_pt)
print("agree:", np.allclose(r, r_pt))

synk.close()
