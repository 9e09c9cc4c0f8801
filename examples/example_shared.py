"""The shared-variable worked example: each process holds its own copy.

Run with two processes: ``python examples/example_shared.py``.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

synk.fork(n_parallel=2)

s_init = np.ones(2, dtype="int64")
s = pytensor.shared(s_init, name="s")
x = pt.lmatrix("x")
f = synk.function([x], updates=[(s, pt.sum(x * s, axis=0))])
synk.distribute()

x_dat = np.array([[1, 1], [2, 2], [3, 3], [4, 4]], dtype="int64")

print("Single process (as_pytensor):")
f.as_pytensor(x_dat)
print("s:", s.get_value())

synk.broadcast(s, s_init)
f(x_dat)
print("\nAfter the distributed call:")
print("rank 0:", synk.get_value(0, s), " rank 1:", synk.get_value(1, s))
print("gather(s, nd_up=1):", synk.gather(s, nd_up=1).tolist())

synk.reduce(s, op="sum")
print("\nAfter reduce(s, op='sum') (in place):")
print("rank 0:", synk.get_value(0, s), " rank 1:", synk.get_value(1, s))

synk.broadcast(s, s_init)
f(x_dat)
synk.all_reduce(s, op="sum")
print("\nAfter broadcast, call, all_reduce(s, op='sum'):")
print("rank 0:", synk.get_value(0, s), " rank 1:", synk.get_value(1, s))

synk.close()
