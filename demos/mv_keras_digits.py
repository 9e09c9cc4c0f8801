"""Train a Keras 3 MLP on scikit-learn's digits through a parameter-server table.

The Keras demo of ``synkhronos.multiverso``: every worker runs
``model.fit()`` on its own share of the training images with
``MVCallback(model)``, which after every ``--freq`` minibatches adds this
worker's change of the weights to one table and loads the sum of every
worker's changes (Multiverso's ``keras_ext`` callback, on Keras 3). Keras
runs on its PyTorch backend here (``KERAS_BACKEND=torch`` unless set; JAX
or TensorFlow work the same). It runs the same training on one worker first
(in a child process) and then on several, so the speed-up over one worker
is measured on this machine, and shows:

* ``mv.init()`` forking the workers (no launcher), every one running the
  rest of the script; ``mpirun -np 2 python demos/mv_keras_digits.py`` runs
  the same script on MPI ranks instead (then without the 1-worker run);
* a progress bar per epoch, validation accuracy, and a plot of the loss
  curves (``demos/results/mv_keras_digits.png``).

80% of the digits train, 20% validate; the training images are also used
shifted by one pixel up, down, left and right. Exits with status 1 if the
validation accuracy is below 93%. Needs ``pip install -e '.[keras,torch,demo]'``.

Usage::

    python demos/mv_keras_digits.py                      # 1 worker, then one per core
    python demos/mv_keras_digits.py --workers 2 --epochs 5 --no-baseline
    mpirun -np 2 python demos/mv_keras_digits.py
"""

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402 - once, before the fork, not in every worker
import numpy as np  # noqa: E402

import synkhronos.multiverso as mv  # noqa: E402
from synkhronos.multiverso.keras_ext import MVCallback  # noqa: E402
from mv_common import main as run  # noqa: E402 - shared by the two demos

# ---------------------------------------------------------------------------
# Model


def build(args):
    keras.utils.set_random_seed(args.seed + mv.worker_id())   # different everywhere: the master's wins
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(args.hidden, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def set_threads(threads):
    """Threads of the backend's own pool (PyTorch's; the others follow OpenMP and BLAS limits)."""
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)


class Epochs(keras.callbacks.Callback):
    """A progress bar per epoch on the master; at the end of every epoch a barrier (the epoch
    ends when every worker's share is done), then the master validates."""

    def __init__(self, args, data, history):
        super().__init__()
        self.args, self.history = args, history
        self.x_val, self.y_val = data[1], data[3]
        self.master = mv.is_master_worker()
        self.bar = None

    def on_epoch_begin(self, epoch, logs=None):
        mv.barrier()
        if self.master and not self.args.no_progress and sys.stdout.isatty():
            from tqdm import tqdm

            n = mv.workers_num()
            self.bar = tqdm(total=self.params["steps"], ncols=88, file=sys.stdout, leave=False,
                            desc=f"{n} worker{'s' if n > 1 else ''}  epoch {epoch + 1:2d}/{self.args.epochs}")
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{float(logs['loss']):.4f}")

    def on_epoch_end(self, epoch, logs=None):
        mv.barrier()
        h = self.history
        h["epoch_s"].append(time.perf_counter() - self.t0)
        if self.bar is not None:
            self.bar.close()
        if not self.master:
            return
        logits = keras.ops.convert_to_numpy(self.model(self.x_val, training=False)).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        log_prob = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        h["val_loss"].append(float(-log_prob[np.arange(len(self.y_val)), self.y_val].mean()))
        h["val_acc"].append(float((logits.argmax(axis=1) == self.y_val).mean()))
        h["train_loss"].append(float(logs["loss"]))
        n = h["n"]
        print(f"{n} worker{'s' if n > 1 else ' '}  epoch {epoch + 1:2d}  train loss {h['train_loss'][-1]:.4f}"
              f"  val loss {h['val_loss'][-1]:.4f}  val acc {h['val_acc'][-1]:.2%}"
              f"  ({h['epoch_s'][-1]:.2f} s)", flush=True)


# ---------------------------------------------------------------------------
# One run: every worker runs this after mv.init()


def train(args, data):
    """fit() on this worker's share with MVCallback; the master's history."""
    x_train, _, y_train, _ = data
    n, me = mv.workers_num(), mv.worker_id()
    mine = np.arange(me, len(x_train), n)            # this worker's share of the images
    model = build(args)
    sync = MVCallback(model, freq=args.freq)          # every worker starts from the master's weights
    history = {"train_loss": [], "val_loss": [], "val_acc": [], "epoch_s": [], "n": n}
    model.fit(x_train[mine], y_train[mine], batch_size=args.batch_size, epochs=args.epochs,
              shuffle=True, verbose=0, callbacks=[sync, Epochs(args, data, history)])
    history["threads"] = args.threads
    return history


def main(argv=None):
    return run(__doc__, __file__, train, set_threads, "threads", argv)


if __name__ == "__main__":
    sys.exit(main())
