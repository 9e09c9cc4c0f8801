"""Train a classifier on scikit-learn's handwritten digits, data-parallel.

The headline demo (``make demo``): an MLP (or, with ``--model cnn``, a small
convolutional net) trained with a data-parallel Adam step from
:mod:`synkhronos.extensions`, first on one process and then on several, in
the same run, so the speed-up is measured on this machine. It shows:

* the training set in shared memory (``synk.data``): each step sends only the
  indices of a shuffled minibatch (``batch=``) and every process gathers its
  own rows;
* one all-reduce of one flat gradient vector per step; every process applies
  the same update, so the replicas stay identical;
* a progress bar per epoch, validation accuracy, and a plot of the loss
  curves (``demos/results/``);
* the same script on several nodes (``make demo-mpi``: ``mpirun -np 2``):
  every node holds the data, and of each minibatch every node passes its
  own share (``synk.shard``), so each step sees the same minibatch as on one
  node and every node's replica takes the same update.

The digits (1797 images of 8x8 pixels) ship with scikit-learn: nothing is
downloaded. 80% train, 20% validate; the training images are also used
shifted by one pixel up, down, left and right (``--no-augment`` turns that
off). Exits with status 1 if the validation accuracy of the parallel run
is below 95%.

Usage::

    python demos/train_digits.py                 # MLP, 1 process then all cores
    python demos/train_digits.py --model cnn     # small CNN
    python demos/train_digits.py --workers 2 --epochs 20 --no-baseline
    mpirun -np 2 --bind-to none python demos/train_digits.py --workers 1 --no-baseline
"""

import argparse
import os
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import make_train_function

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPE = "float32"
TARGET_ACCURACY = 0.95


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mlp", "cnn"), default="mlp", help="default: mlp")
    p.add_argument("--workers", type=int, default=None,
                   help="processes of the parallel run (default: one per core, at least 2)")
    p.add_argument("--epochs", type=int, default=None, help="default: 20 (mlp) or 15 (cnn)")
    p.add_argument("--batch-size", type=int, default=256, help="default: 256")
    p.add_argument("--rule", default="adam", help="update rule from synkhronos.extensions.updates (default: adam)")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="default: 0.002 (mlp) or 0.003 (cnn)")
    p.add_argument("--hidden", type=int, default=512, help="width of the hidden layers (default: 512)")
    p.add_argument("--no-augment", action="store_true",
                   help="train on the images only, not also on copies shifted by one pixel")
    p.add_argument("--no-baseline", action="store_true", help="skip the 1-process run")
    p.add_argument("--results", default=os.path.join(HERE, "results"), help="where the plot goes (default: demos/results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (they show only on a terminal)")
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu",
                   help="synk.fork's device (default: cpu); on a GPU, name --workers (one per GPU) and "
                        "--no-baseline: a process where CUDA is up cannot fork GPU workers again")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = 20 if args.model == "mlp" else 15
    if args.learning_rate is None:
        args.learning_rate = 0.002 if args.model == "mlp" else 0.003
    if args.workers is None:
        args.workers = max(2, len(os.sched_getaffinity(0)))
    return args


# ---------------------------------------------------------------------------
# Data


def load_data(seed, augment=True):
    """Digits scaled to [0, 1], split 80/20; the training images also shifted by one pixel."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(DTYPE)
    y = digits.target.astype("int64")
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    if augment:
        x_train, y_train = shifted(x_train, y_train)
    return x_train, x_val, y_train, y_val


def shifted(x, y):
    """The images plus copies moved one pixel up, down, left and right (blank edge filled with 0)."""
    images = x.reshape(-1, 8, 8)
    out = [images]
    for axis, step in ((1, 1), (1, -1), (2, 1), (2, -1)):
        moved = np.roll(images, step, axis=axis)
        edge = [slice(None)] * 3
        edge[axis] = 0 if step > 0 else -1
        moved[tuple(edge)] = 0
        out.append(moved)
    return np.concatenate(out).reshape(-1, 64), np.tile(y, len(out))


# ---------------------------------------------------------------------------
# Models: plain PyTensor; the parameters are shared variables.


def _dense(rng, n_in, n_out, name):
    scale = np.sqrt(2.0 / n_in)  # He initialisation for ReLU layers
    w = pytensor.shared((rng.standard_normal((n_in, n_out)) * scale).astype(DTYPE), name=f"{name}_W")
    b = pytensor.shared(np.zeros(n_out, dtype=DTYPE), name=f"{name}_b")
    return w, b


def build_mlp(x, rng, hidden):
    w1, b1 = _dense(rng, 64, hidden, "h1")
    w2, b2 = _dense(rng, hidden, hidden, "h2")
    w3, b3 = _dense(rng, hidden, 10, "out")
    h = pt.maximum(x @ w1 + b1, 0)
    h = pt.maximum(h @ w2 + b2, 0)
    return h @ w3 + b3, [w1, b1, w2, b2, w3, b3]


def _patch_index(size=8, k=3):
    """Pixel indices of every k x k patch of a size x size image (im2col)."""
    out = size - k + 1
    rows = []
    for i in range(out):
        for j in range(out):
            rows.append([(i + di) * size + (j + dj) for di in range(k) for dj in range(k)])
    return np.array(rows, dtype="int64"), out


def build_cnn(x, rng, hidden, filters=32):
    """3x3 convolution (as a matrix product over patches), ReLU, 2x2 max-pool, two dense layers."""
    idx, out = _patch_index()
    wc, bc = _dense(rng, 9, filters, "conv")
    patches = x[:, idx]                                       # (n, 36, 9)
    conv = pt.maximum(pt.tensordot(patches, wc, axes=[[2], [0]]) + bc, 0)   # (n, 36, filters)
    conv = conv.reshape((x.shape[0], out // 2, 2, out // 2, 2, filters))
    pooled = conv.max(axis=(2, 4)).reshape((x.shape[0], (out // 2) ** 2 * filters))
    w1, b1 = _dense(rng, (out // 2) ** 2 * filters, hidden, "h1")
    w2, b2 = _dense(rng, hidden, 10, "out")
    h = pt.maximum(pooled @ w1 + b1, 0)
    return h @ w2 + b2, [wc, bc, w1, b1, w2, b2]


def build(args):
    """Symbolic inputs, loss, accuracy and parameters (fresh, seeded: equal in every run)."""
    rng = np.random.default_rng(args.seed)
    x, y = pt.matrix("x", dtype=DTYPE), pt.lvector("y")
    logits, params = (build_mlp if args.model == "mlp" else build_cnn)(x, rng, args.hidden)
    log_prob = pt.special.log_softmax(logits, axis=-1)
    # each row's log-probability of its label, as a mask of constant classes: PyTensor 3.0.7's
    # JAX backend fails on pt.arange(y.shape[0]) (an int8 start; seen on the GPU device)
    picked = pt.eq(y[:, None], np.arange(10))
    loss = -pt.mean(pt.sum(log_prob * picked, axis=-1))
    accuracy = pt.mean(pt.eq(pt.argmax(logits, axis=-1), y))
    return x, y, loss, accuracy, params


# ---------------------------------------------------------------------------
# One run on n processes.


def progress(iterable, total, desc, enabled):
    # bars only on a terminal: redrawn into a log file they would fill it
    if not enabled or not sys.stdout.isatty():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, ncols=88, file=sys.stdout)


def run(n_parallel, args, data):
    """Fork n processes, train, evaluate every epoch, close. Returns the history."""
    x_train, x_val, y_train, y_val = data
    n = synk.fork(n_parallel, device=args.device)
    world = synk.world()  # under mpirun: this node among all; else node 0 of 1
    if world.node != 0:
        args = argparse.Namespace(**{**vars(args), "no_progress": True})
    say = print if world.node == 0 else (lambda *a, **k: None)
    try:
        x, y, loss, accuracy, params = build(args)
        step = make_train_function(loss, params, [x, y], args.rule, learning_rate=args.learning_rate)
        evaluate = synk.function([x, y], [loss, accuracy])  # "avg" weighs processes by rows
        t0 = time.perf_counter()
        synk.distribute()
        setup_s = time.perf_counter() - t0
        # In shared memory once; each step sends only the indices of its minibatch.
        xd, yd = synk.data(x_train, name="x_train"), synk.data(y_train, name="y_train")
        xv, yv = synk.data(x_val, name="x_val"), synk.data(y_val, name="y_val")
        order = np.random.default_rng(args.seed + 1)
        n_batches = -(-len(x_train) // args.batch_size)
        history = {"train_loss": [], "val_loss": [], "val_acc": [], "epoch_s": []}
        for epoch in range(1, args.epochs + 1):
            perm = order.permutation(len(x_train))
            t0 = time.perf_counter()
            total, seen = 0.0, 0
            bar = progress(range(n_batches), n_batches, f"{n} proc  epoch {epoch:2d}/{args.epochs}",
                           not args.no_progress)
            for b in bar:
                idx = perm[b * args.batch_size:(b + 1) * args.batch_size]
                # each node its share of the minibatch (all of it on one node)
                batch_loss = step(xd, yd, batch=idx[synk.shard(len(idx))])
                total, seen = total + batch_loss * len(idx), seen + len(idx)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{batch_loss:.4f}")
            history["epoch_s"].append(time.perf_counter() - t0)
            val_loss, val_acc = evaluate(xv, yv, batch=synk.shard(len(x_val)))
            history["train_loss"].append(total / seen)
            history["val_loss"].append(float(val_loss))
            history["val_acc"].append(float(val_acc))
            say(f"{world.size} proc  epoch {epoch:2d}  train loss {total / seen:.4f}  val loss {float(val_loss):.4f}"
                  f"  val acc {float(val_acc):.2%}  ({history['epoch_s'][-1]:.2f} s)", flush=True)
        history["setup_s"] = setup_s
        history["n"] = world.size  # every process of every node
        history["node"], history["nodes"] = world.node, world.nodes
        history["threads"] = blas_threads()
        return history
    finally:
        synk.close()


def _threads(n: int) -> str:
    return f"{n} BLAS thread{'' if n == 1 else 's'}"


def blas_threads():
    """Threads the BLAS of this process may use (synk.fork sets cores // processes)."""
    from threadpoolctl import threadpool_info

    counts = [pool["num_threads"] for pool in threadpool_info() if pool.get("user_api") == "blas"]
    return max(counts) if counts else 1


# ---------------------------------------------------------------------------
# Report


def plot(histories, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"train_digits_{args.model}.png")
    fig, (ax_loss, ax_time, ax_acc) = plt.subplots(1, 3, figsize=(15, 4))
    for h in histories:
        epochs = np.arange(1, len(h["train_loss"]) + 1)
        ax_loss.plot(epochs, h["train_loss"], label=f"train, {h['n']} proc")
        ax_loss.plot(epochs, h["val_loss"], "--", label=f"validation, {h['n']} proc")
        ax_time.plot(np.cumsum(h["epoch_s"]), h["train_loss"], marker=".", label=f"{h['n']} proc")
        ax_acc.plot(epochs, h["val_acc"], label=f"{h['n']} proc")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", yscale="log",
                title="loss per epoch (equal up to rounding)")
    ax_time.set(xlabel="training time (s)", ylabel="train cross-entropy", yscale="log",
                title="train loss against wall-clock time")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="validation accuracy", ylim=(0.8, 1.0))
    ax_acc.axhline(TARGET_ACCURACY, color="grey", lw=0.8, ls=":")
    for ax in (ax_loss, ax_time, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"synkhronos: {args.model.upper()} on scikit-learn digits, {args.rule}, "
                 f"batch {args.batch_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    data = load_data(args.seed, augment=not args.no_augment)
    print(f"digits: {len(data[0])} training and {len(data[1])} validation images; model {args.model}, "
          f"rule {args.rule}, batch {args.batch_size}, {args.epochs} epochs", flush=True)
    runs = [] if args.no_baseline or args.workers == 1 else [1]
    runs.append(args.workers)
    histories = [run(n, args, data) for n in runs]
    if histories[-1]["node"] != 0:  # under mpirun: node 0 reports
        return 0 if histories[-1]["val_acc"][-1] >= TARGET_ACCURACY else 1
    path = plot(histories, args)
    if histories[-1]["nodes"] > 1:
        print(f"{histories[-1]['nodes']} nodes, {histories[-1]['n']} processes in all")

    print("\nprocesses  BLAS threads each  setup (s)  train time (s)  time/epoch (s)  final val acc")
    for h in histories:
        train_s = sum(h["epoch_s"])
        print(f"{h['n']:>9d}  {h['threads']:>17d}  {h['setup_s']:9.2f}  {train_s:14.2f}"
              f"  {train_s / len(h['epoch_s']):14.3f}  {h['val_acc'][-1]:13.2%}")
    final = histories[-1]
    if len(histories) > 1:
        # epoch 1 is left out: it includes PyTensor's first-call overheads
        base, par = (np.median(h["epoch_s"][1:] or h["epoch_s"]) for h in histories)
        total_base, total_par = (sum(h["epoch_s"]) for h in histories)
        print(f"speed-up of {final['n']} processes over 1: {base / par:.2f}x (median epoch time), "
              f"{total_base / total_par:.2f}x (total training time)")
        print(f"(the 1-process run used {_threads(histories[0]['threads'])}, each of the "
              f"{final['n']} processes {_threads(final['threads'])}; the speed-up is of the processes "
              "over threaded BLAS, and depends on what else runs on the machine)")
    print(f"loss curves: {path}")
    ok = final["val_acc"][-1] >= TARGET_ACCURACY
    print(f"validation accuracy with {final['n']} processes: {final['val_acc'][-1]:.2%} "
          f"({'reached' if ok else 'BELOW'} the {TARGET_ACCURACY:.0%} target)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
