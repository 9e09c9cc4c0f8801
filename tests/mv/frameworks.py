"""Keras 3 and PyTorch training on the tables, run as a script (every worker runs it).

    python frameworks.py SERVER NUM_WORKERS [TOKEN]
    mpirun -np N python frameworks.py SERVER 0 [TOKEN]

SERVER is ``sync`` or ``async``. In one job (one import of Keras and PyTorch):
tensors in and out of the tables, a small Keras model trained with
``MVCallback`` and a small PyTorch model trained with ``TorchParamManager``,
and (``sync`` only) the bad arguments. Every worker checks its results and
raises on the first wrong one; each prints ``PASS <part> rank <r> of <n>``.

How the checks work: every worker's weights and changes travel through a
float64 check table (one row per worker). With a sync server, after every
sync all workers must hold exactly the same weights, and they must equal
the previous synced weights plus every worker's change since then (the
delta rule). With an async server the order of adds is free, so the check
is made once, after a barrier and a last sync: the same weights everywhere,
equal to the master's initial weights plus every change of every worker.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import keras  # noqa: E402,F401 - once, before the fork, not in every worker
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - the first optimizer step imports it: once, before the fork

import synkhronos.multiverso as mv  # noqa: E402
from synkhronos.errors import SynkError  # noqa: E402
from scenarios import check, raises  # noqa: E402 - this folder's checks

N_IN, ROWS, BATCH = 8, 64, 16


def shard(me):
    """This worker's own data: a noisy linear target (different rows on every worker)."""
    rng = np.random.default_rng(100 + me)
    x = rng.standard_normal((ROWS, N_IN)).astype(np.float32)
    w = np.linspace(-1, 1, N_IN).astype(np.float32)
    y = (x @ w + 0.1 * rng.standard_normal(ROWS)).astype(np.float32)[:, None]
    return x, y


class Tracker:
    """Shares (change since the last sync, weights after this sync) of every worker and checks
    the delta rule; ``sync`` tells whether the server makes every sync exact."""

    def __init__(self, size, sync):
        self.n, self.me, self.size, self.sync = mv.workers_num(), mv.worker_id(), size, sync
        self.table = mv.MatrixTableHandler(self.n, 2 * size, dtype=np.float64)
        self.row = np.zeros(2 * size)
        self.total = np.zeros(size)      # this worker's changes, summed
        self.syncs = 0

    def share(self, first, second):
        """Every worker's ``[first, second]`` row, after a barrier (exact with any server)."""
        new = np.concatenate([first, second])
        self.table.add(new - self.row, row_ids=[self.me])
        self.row = new
        mv.barrier()
        rows = self.table.get()
        mv.barrier()  # nobody adds its next row before everyone has read this one
        return rows[:, :self.size], rows[:, self.size:]

    def start(self, local, after):
        """After the manager is made: every worker holds the master's initial weights."""
        firsts, afters = self.share(local, after)
        check(np.array_equal(after, firsts[0]), "weights after the manager are not the master's")
        check(np.all(afters == afters[0]), "workers start from different weights")
        if self.n > 1:
            check(not np.array_equal(firsts[0], firsts[1]), "the test needs different local inits")
        self.initial = after

    def synced(self, last, before, after, label, moved=True):
        delta = before - last
        self.total += delta
        self.syncs += 1
        if not self.sync:
            return
        deltas, afters = self.share(delta, after)
        check(np.all(afters == afters[0]), f"{label} sync {self.syncs}: workers differ after the sync")
        expected = last + deltas.sum(axis=0)
        check(np.allclose(after, expected, rtol=1e-5, atol=1e-5),
              f"{label} sync {self.syncs}: off the delta rule by {np.abs(after - expected).max()}")
        for k in range(self.n if moved else 0):  # each change is large enough to show if lost
            check(np.abs(deltas[k]).max() > 1e-3, f"{label}: worker {k} changed nothing")

    def finish(self, after, label):
        totals, afters = self.share(self.total, after)
        check(np.all(afters == afters[0]), f"{label}: workers differ at the end")
        expected = self.initial + totals.sum(axis=0)
        check(np.allclose(after, expected, rtol=1e-5, atol=1e-5),
              f"{label}: end off the delta rule by {np.abs(after - expected).max()}")
        check(np.abs(after - self.initial).max() > 1e-2, f"{label}: training changed nothing")


# -- tensors in and out of the tables ------------------------------------------------------

def tensors():
    n = mv.workers_num()
    t = mv.ArrayTableHandler(6)
    m = mv.MatrixTableHandler(3, 2, dtype=np.float64)
    mv.barrier()
    t.add(torch.arange(6.0, requires_grad=True))
    t.add(torch.ones(2, 3, dtype=torch.bfloat16))
    m.add(torch.ones(3, 2), row_ids=torch.tensor([0, 1, 2]))
    mv.barrier()
    exp = (np.arange(6.0) + 1) * n
    got = t.get(as_tensor=True)
    check(isinstance(got, torch.Tensor) and got.dtype == torch.float32 and
          np.array_equal(got.numpy(), exp), f"as_tensor: {got}")
    check(isinstance(t.get(), np.ndarray), "numpy by default")
    param = torch.zeros(2, 3, requires_grad=True)   # a leaf needing grad, filled as through .data
    check(t.get(out=param) is param and np.array_equal(param.detach().numpy().ravel(), exp),
          f"out=tensor: {param}")
    rows = m.get(row_ids=[2, 0], as_tensor=True)
    check(rows.dtype == torch.float64 and rows.shape == (2, 2) and bool((rows == n).all()),
          f"matrix rows as_tensor: {rows}")
    buf = np.empty(6, dtype=np.float32)
    shared = t.get(out=buf, as_tensor=True)
    shared[0] = -1.0
    check(buf[0] == -1.0, "as_tensor with a numpy out shares out's memory")
    raises(TypeError, "out has dtype torch.float64 but the table holds float32", t.get,
           out=torch.zeros(6, dtype=torch.float64))
    raises(ValueError, "non-contiguous tensor", t.get, out=torch.zeros(12)[::2])
    raises(TypeError, "as_tensor must be True or False, got 'yes'", t.get, as_tensor="yes")
    raises(TypeError, "got a tensor of dtype torch.complex64", t.add, torch.ones(6, dtype=torch.complex64))
    mv.barrier()


# -- Keras 3 -------------------------------------------------------------------------------

def keras_model(seed, with_input=True):
    keras.utils.set_random_seed(seed)          # a different initial model on every worker
    layers = [keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)]
    model = keras.Sequential(([keras.Input((N_IN,))] if with_input else []) + layers)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def keras_flat(model):
    return np.concatenate([w.reshape(-1) for w in model.get_weights()]).astype(np.float64)


class Watch(keras.callbacks.Callback):
    """Two of them bracket MVCallback: the weights before its sync, then the checks after."""

    def __init__(self, mvcb, tracker, state, after):
        super().__init__()
        self.mvcb, self.tracker, self.state, self.after = mvcb, tracker, state, after

    def on_train_batch_end(self, batch, logs=None):
        weights = keras_flat(self.model)
        if not self.after:
            self.state["before"] = weights
        elif self.mvcb.cur_n == 0:                  # MVCallback has just synced
            self.tracker.synced(self.state["last"], self.state["before"], weights, "keras")
            self.state["last"] = weights


def keras_training(sync, freq):
    from synkhronos.multiverso.keras_ext import MVCallback

    me = mv.worker_id()
    model = keras_model(me)
    local = keras_flat(model)
    mvcb = MVCallback(model, freq=freq)           # built: the manager is made here, as Multiverso
    tracker = Tracker(local.size, sync)
    state = {"last": keras_flat(model)}
    tracker.start(local, state["last"])
    x, y = shard(me)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[Watch(mvcb, tracker, state, False), mvcb,
                         Watch(mvcb, tracker, state, True)])
    check(tracker.syncs == 2 * (ROWS // BATCH) // freq, f"keras: {tracker.syncs} syncs")
    mv.barrier()
    before = keras_flat(model)
    mvcb.kpm.sync_all_param()                     # after a barrier: every change is in
    tracker.synced(state["last"], before, keras_flat(model), "keras final", moved=False)
    tracker.finish(keras_flat(model), "keras")
    # unbuilt at construction (no Input): the manager is made when fit() starts, from the master
    lazy = keras_model(10 + me, with_input=False)
    lazy_cb = MVCallback(lazy, freq=1)
    check(lazy_cb.kpm is None, "an unbuilt model has no manager before fit()")
    seen = {}
    lazy.fit(x, y, batch_size=ROWS, epochs=1, verbose=0,
             callbacks=[AtBegin(seen, "local"), lazy_cb, AtBegin(seen, "after")])
    Tracker(seen["local"].size, sync).start(seen["local"], seen["after"])


class AtBegin(keras.callbacks.Callback):
    """Records the weights when fit() starts (before or after MVCallback's on_train_begin)."""

    def __init__(self, seen, key):
        super().__init__()
        self.seen, self.key = seen, key

    def on_train_begin(self, logs=None):
        self.seen[self.key] = keras_flat(self.model)


# -- PyTorch -------------------------------------------------------------------------------

def torch_model(seed):
    torch.manual_seed(seed)                     # a different initial model on every worker
    return torch.nn.Sequential(torch.nn.Linear(N_IN, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def torch_flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def torch_training(sync, freq):
    from synkhronos.multiverso.torch_ext import TorchParamManager

    me = mv.worker_id()
    model = torch_model(me)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)   # made before the manager: still works
    local = torch_flat(model)
    pm = TorchParamManager(model)
    tracker = Tracker(local.size, sync)
    last = torch_flat(model)
    tracker.start(local, last)
    x, y = (torch.from_numpy(a) for a in shard(me))
    steps = 2 * (ROWS // BATCH)
    for step in range(steps):
        rows = slice((step * BATCH) % ROWS, (step * BATCH) % ROWS + BATCH)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        if (step + 1) % freq == 0:
            before = torch_flat(model)
            pm.sync_all_param()
            last_new = torch_flat(model)
            tracker.synced(last, before, last_new, "torch")
            last = last_new
    check(tracker.syncs == steps // freq, f"torch: {tracker.syncs} syncs")
    mv.barrier()
    before = torch_flat(model)
    pm.sync_all_param()
    tracker.synced(last, before, torch_flat(model), "torch final", moved=False)
    tracker.finish(torch_flat(model), "torch")


# -- bad arguments -------------------------------------------------------------------------

def bad_arguments():
    from synkhronos.multiverso.keras_ext import KerasParamManager, MVCallback
    from synkhronos.multiverso.torch_ext import TorchParamManager

    model = keras_model(0)
    raises(ValueError, "freq must be at least 1", MVCallback, model, freq=0)
    raises(ValueError, "got -2", MVCallback, model, freq=-2)
    raises(TypeError, "freq must be an int", MVCallback, model, freq=1.5)
    raises(TypeError, "got True", MVCallback, model, freq=True)
    raises(TypeError, "MVCallback needs a keras.Model, got Dense", MVCallback, keras.layers.Dense(2))
    raises(TypeError, "KerasParamManager needs a keras.Model, got list", KerasParamManager, [1])
    raises(ValueError, "has no weights yet", KerasParamManager, keras_model(0, with_input=False))
    raises(TypeError, "needs a torch.nn.Module, got list", TorchParamManager, [1, 2])
    raises(TypeError, "buffers must be True or False", TorchParamManager, torch.nn.Linear(2, 2),
           buffers=1)
    # fit() on another model than the callback's: a clear error when training starts
    cb = MVCallback(model)
    other = keras_model(1)
    x, y = shard(0)
    raises(ValueError, "MVCallback was made for the model", other.fit, x, y, verbose=0,
           callbacks=[cb])


def main():
    server, n = sys.argv[1], int(sys.argv[2])
    sync = server == "sync"
    mv.init(sync=sync, num_workers=n or None)
    tensors()
    print(f"PASS tensors rank {mv.worker_id()} of {mv.workers_num()}", flush=True)
    keras_training(sync, freq=1 if sync == (n == 0) else 2)
    print(f"PASS keras rank {mv.worker_id()} of {mv.workers_num()}", flush=True)
    torch_training(sync, freq=2 if sync == (n == 0) else 1)
    print(f"PASS torch rank {mv.worker_id()} of {mv.workers_num()}", flush=True)
    if sync:
        bad_arguments()
        print(f"PASS errors rank {mv.worker_id()} of {mv.workers_num()}", flush=True)
    mv.shutdown()
    raises(SynkError, "after multiverso.shutdown()", mv.ArrayTableHandler, 2)


if __name__ == "__main__":
    main()
