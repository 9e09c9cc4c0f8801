"""A script written against the original Synkhronos's documented API, ported by
renaming ``theano`` to ``pytensor`` and nothing else.

It uses only the names and keywords of the original's documentation (fork,
function, distribute, data and Data, Function, the collectives, get_n_gpu,
close) and builds float32 data through ``floatX``, as scripts for the
original did: run it with ``PYTENSOR_FLAGS=floatX=float32``.
tests/test_port.py runs it unchanged, in a fresh process.

Usage: python tests/original_style.py [n_parallel]
"""

import sys

import numpy as np
import pytensor
import pytensor.tensor as T

import synkhronos as synk

n_parallel = int(sys.argv[1]) if len(sys.argv) > 1 else None
n = synk.fork(n_parallel, use_gpu=True, master_rank=0, profile_workers=False,
              max_n_var=1000, max_dim=16)
floatX = pytensor.config.floatX
assert floatX == "float32", f"run with PYTENSOR_FLAGS=floatX=float32 (floatX is {floatX})"
assert synk.get_n_gpu() >= 0
rng = np.random.RandomState(7)


def close(a, b):
    return np.allclose(a, b, rtol=1e-4, atol=1e-4)


# -- functions: scattered and broadcast inputs, output reductions, slices ----

x = T.matrix("x")
y = T.matrix("y")
prod = x.dot(y)
f = synk.function(inputs=[x], bcast_inputs=[y],
                  outputs=[T.mean(prod, axis=0), (T.sum(prod, axis=0), "sum"),
                           (T.max(prod, axis=0), "max"), (T.min(prod), "min"),
                           (prod, "gather")])
synk.distribute()
assert f.output_modes == ["avg", "sum", "max", "min", "gather"], f.output_modes
x_dat = rng.randn(60 * n + 1, 6).astype(floatX)
y_dat = rng.randn(6, 3).astype(floatX)
expected = f.as_theano(x_dat, y_dat)
x_synk, y_synk = f.build_inputs(x_dat, y_dat)
for num_slices in (1, 3):
    got = f(x_synk, y_synk, num_slices=num_slices)
    for e, g in zip(expected, got):
        assert close(e, g), (num_slices, e, g)
got = f(x_dat, y_dat, output_subset=[1])
assert close(got[0], expected[1])
print("functions: outputs agree with as_theano")

# -- synk.data life cycle ------------------------------------------------------

d = synk.data(var=x, shape=(5, 6), name="d")
assert d.shape == (5, 6) and d.dtype == floatX and d.ndim == 2 and len(d) == 5
assert d.name == "d" and not d.minibatch and np.all(d.data == 0)
d[:] = x_dat[:5]
assert close(d[2:4], x_dat[2:4])
d.set_value(x_dat[:40], oversize=1.5)
assert d.size == 40 * 6 and d.alloc_size >= 60 * 6
d.set_value(x_dat[:50])  # fits: same allocation
assert d.alloc_size >= 60 * 6
d.set_length(20)
assert d.shape == (20, 6) and close(d.data, x_dat[:20])
d.set_shape((10, 6))
assert d.shape == (10, 6)
d.free_memory()
assert d.alloc_size == 0 and d.size == 0
d.set_value(x_dat[:8])
assert d.alloc_size == 8 * 6
conditioned = d.condition_data(x_dat[:3].astype("float64"), force_cast=True)
assert conditioned.dtype == floatX
d.set_value(x_dat[:30].astype("float64"), force_cast=True)
assert close(f(d, y_dat)[1], f.as_theano(x_dat[:30], y_dat)[1])
print("data: life cycle checks passed")

# -- batch, minibatch data, slices ---------------------------------------------

w = T.matrix("w")
g = synk.function(inputs=[x, w], bcast_inputs=[y], outputs=(T.sum((x + w).dot(y), axis=0), "sum"))
w_dat = rng.randn(30, 6).astype(floatX)
w_synk = synk.data(w_dat, minibatch=True)
xs = synk.data(x_dat)
for batch in (25, slice(10, 40), rng.randint(0, len(x_dat), size=30)):
    rows = x_dat[:batch] if isinstance(batch, int) else x_dat[batch]
    want = g.as_theano(rows, w_dat[:len(rows)], y_dat)
    for num_slices in (1, 2):
        assert close(g(xs, w_synk, y_dat, batch=batch, num_slices=num_slices), want)
print("batch: selections agree with as_theano")

# -- shared variables: collectives, differing shapes, batch_s --------------------

rows_each = 12
s_x = pytensor.shared(np.zeros((rows_each, 6), dtype=floatX), name="s_x")
s_y = pytensor.shared(np.zeros((6, 3), dtype=floatX), name="s_y")
h = synk.function(inputs=[], outputs=(T.sum(s_x.dot(s_y), axis=0), "sum"), sliceable_shareds=[s_x])
x_all = rng.randn(rows_each * n, 6).astype(floatX)
synk.scatter(s_x, x_all)
synk.broadcast(s_y, y_dat, nccl=True)
assert list(synk.get_lengths(s_x)) == [rows_each] * n
assert synk.get_shapes(s_y) == [(6, 3)] * n
assert close(synk.gather(s_x, nd_up=0, nccl=False), x_all)
assert close(synk.get_value(n - 1, s_x), x_all[-rows_each:])
y_copies = synk.gather(s_y, nd_up=1, nccl=True)
assert y_copies.shape == (n, 6, 3) and close(y_copies[0], y_dat)
plain = T.matrix("a")
whole = pytensor.function([plain], T.sum(plain.dot(y_dat), axis=0))
assert close(h(), whole(x_all))
assert close(h(num_slices=2), whole(x_all))
sel = slice(2, 9)
assert close(h(batch_s=sel), whole(np.concatenate([x_all[r * rows_each:][sel] for r in range(n)])))
per_rank = [rng.randint(0, rows_each, size=5) for _ in range(n)]
assert close(h(batch_s=per_rank, num_slices=2),
             whole(np.concatenate([x_all[r * rows_each:][idx] for r, idx in enumerate(per_rank)])))

before = synk.gather(s_x, nd_up=1)
synk.all_reduce(s_x, op="avg", nccl=False)
after = synk.gather(s_x, nd_up=1)
for r in range(n):
    assert close(after[r], before.mean(axis=0))
synk.set_value(rank=n - 1, shared_vars=s_x, values=before[n - 1][:5])
assert synk.get_shapes(s_x)[n - 1] == (5, 6)  # shapes may differ per process
total = synk.reduce(s_y, op="sum", in_place=False, nccl=True)
assert close(total, n * y_dat)
gathered = synk.all_gather(s_x, nccl=False)
assert len(gathered) == rows_each * (n - 1) + 5
assert synk.get_shapes(s_x) == [gathered.shape] * n
print("shared variables: collectives checks passed")

# -- updates applied in each process, then combined ----------------------------

s = pytensor.shared(np.ones(2, dtype=floatX), name="s")
u = synk.function(inputs=[x], updates=[(s, T.sum(x * s, axis=0))])
x4 = np.arange(8 * n, dtype=floatX).reshape(4 * n, 2)
u(x4)
synk.reduce(s, op="sum")
assert close(s.get_value(), x4.sum(axis=0))
synk.broadcast(s, np.ones(2, dtype=floatX))
u(x4)
synk.all_reduce(s, op="sum")
assert close(synk.gather(s), np.tile(x4.sum(axis=0), (n, 1)))
print("updates: local updates and reductions passed")

synk.close()
print("original-style script passed")
