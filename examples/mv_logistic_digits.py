"""Logistic regression on scikit-learn's digits with parameter-server tables (Multiverso's API).

Run it with forked workers (no launcher)::

    python examples/mv_logistic_digits.py            # one worker per core
    python examples/mv_logistic_digits.py 3          # three workers

or, the same script, under MPI::

    mpirun -np 2 python examples/mv_logistic_digits.py

Every worker runs the whole script: it builds the same model, trains on its
share of each epoch's minibatches, and after every step adds its change to
the parameters' tables and loads the latest values (``sync_all_mv_shared_vars``).
The master (worker 0) validates after every epoch and prints the accuracy.
"""

import sys

import numpy as np
import pytensor
import pytensor.tensor as pt
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import synkhronos.multiverso as mv
from synkhronos.multiverso.pytensor_ext import mv_shared, sync_all_mv_shared_vars

mv.init(num_workers=int(sys.argv[1]) if len(sys.argv) > 1 and not mv.under_launcher() else None)
rank, workers = mv.worker_id(), mv.workers_num()

digits = load_digits()
x = (digits.data / 16.0).astype(pytensor.config.floatX)
y = digits.target.astype("int64")
x_train, x_valid, y_train, y_valid = train_test_split(x, y, test_size=0.25, random_state=0)

# the master's initial values win: every worker starts from the same model
rng = np.random.default_rng(rank)
W = mv_shared(rng.normal(0, 0.01, (64, 10)).astype(pytensor.config.floatX), name="W")
b = mv_shared(np.zeros(10, dtype=pytensor.config.floatX), name="b")

xs, ys = pt.matrix("x"), pt.lvector("y")
p = pt.special.softmax(xs @ W + b, axis=-1)
cost = -pt.mean(pt.log(p)[pt.arange(ys.shape[0]), ys])
lr = 0.5
gW, gb = pytensor.grad(cost, [W, b])
train = pytensor.function([xs, ys], cost, updates=[(W, W - lr * gW), (b, b - lr * gb)])
predict = pytensor.function([xs], pt.argmax(p, axis=-1))

batch = 32
steps = len(x_train) // batch
for epoch in range(15):
    order = np.random.default_rng(epoch).permutation(len(x_train))  # the same on every worker
    for step in range(rank, steps - steps % workers, workers):        # this worker's share
        idx = order[step * batch:(step + 1) * batch]
        train(x_train[idx], y_train[idx])
        sync_all_mv_shared_vars()                                     # add my change, load the latest
    mv.barrier()
    sync_all_mv_shared_vars()                                         # everybody's last steps
    if mv.is_master_worker():
        acc = np.mean(predict(x_valid) == y_valid)
        print(f"epoch {epoch + 1:2d}: validation accuracy {acc:.3f} ({workers} workers)", flush=True)
    mv.barrier()

mv.shutdown()
