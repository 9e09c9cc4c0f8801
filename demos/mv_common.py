"""What the two parameter-server demos (mv_keras_digits.py, mv_torch_digits.py) share:
the command line, the data, the 1-worker baseline run, the loss plot and the report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import synkhronos.multiverso as mv

TARGET_ACCURACY = 0.93
HERE = os.path.dirname(os.path.abspath(__file__))


def _threads(n: int) -> str:
    return f"{n} thread{'' if n == 1 else 's'}"


def parse_args(description, argv=None, threads_of="threads"):
    """The demos' command line; ``threads_of`` names what ``--threads`` sets."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workers", type=int, default=None,
                   help="workers of the parallel run (default: one per core, at least 2)")
    p.add_argument("--epochs", type=int, default=12, help="default: 12")
    p.add_argument("--batch-size", type=int, default=64, help="default: 64")
    p.add_argument("--learning-rate", type=float, default=0.001, help="Adam's (default: 0.001)")
    p.add_argument("--hidden", type=int, default=256, help="width of the hidden layers (default: 256)")
    p.add_argument("--freq", type=int, default=1, help="sync every FREQ minibatches (default: 1)")
    p.add_argument("--sync", action="store_true", help="a sync server (default: async)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"{threads_of} per worker (default: the cores shared among the workers "
                        "of the parallel run, at least 1; the 1-worker run gets as many, so the "
                        "speed-up compares like with like)")
    p.add_argument("--no-baseline", action="store_true", help="skip the 1-worker run")
    p.add_argument("--results", default=os.path.join(HERE, "results"),
                   help="where the plot goes (default: demos/results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (they show only on a terminal)")
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    p.add_argument("--history", help=argparse.SUPPRESS)   # the 1-worker child writes its history here
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = max(2, len(os.sched_getaffinity(0)))
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.workers)
    return args


def load_data(seed):
    """Digits scaled to [0, 1], split 80/20; the training images also shifted by one pixel."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    images, moved = x_train.reshape(-1, 8, 8), [x_train.reshape(-1, 8, 8)]
    for axis, step in ((1, 1), (1, -1), (2, 1), (2, -1)):
        m = np.roll(images, step, axis=axis)
        edge = [slice(None)] * 3
        edge[axis] = 0 if step > 0 else -1
        m[tuple(edge)] = 0
        moved.append(m)
    return np.concatenate(moved).reshape(-1, 64), x_val, np.tile(y_train, len(moved)), y_val


def baseline(args, script):
    """The same training on 1 worker, in a child process (init() runs once per process):
    ``script`` (the demo's own file) again, with ``--workers 1``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "history.json")
        argv = [sys.executable, os.path.abspath(script), *sys.argv[1:], "--workers", "1",
                "--threads", str(args.threads), "--no-baseline", "--history", path]
        subprocess.run(argv, check=True)
        with open(path) as fh:
            return json.load(fh)


def plot(histories, args, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.results, exist_ok=True)
    path = os.path.join(args.results, f"{name}.png")
    fig, (ax_loss, ax_time, ax_acc) = plt.subplots(1, 3, figsize=(15, 4))
    for h in histories:
        label = f"{h['n']} worker{'s' if h['n'] > 1 else ''}"
        epochs = np.arange(1, len(h["train_loss"]) + 1)
        ax_loss.plot(epochs, h["train_loss"], label=f"train, {label}")
        ax_loss.plot(epochs, h["val_loss"], "--", label=f"validation, {label}")
        ax_time.plot(np.cumsum(h["epoch_s"]), h["val_loss"], marker=".", label=label)
        ax_acc.plot(epochs, h["val_acc"], label=label)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", yscale="log", title="loss per epoch")
    ax_time.set(xlabel="training time (s)", ylabel="validation cross-entropy", yscale="log",
                title="validation loss against wall-clock time")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="validation accuracy", ylim=(0.8, 1.0))
    ax_acc.axhline(TARGET_ACCURACY, color="grey", lw=0.8, ls=":")
    for ax in (ax_loss, ax_time, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"synkhronos.multiverso: {name}, sync every {args.freq} "
                 f"minibatch(es) of {args.batch_size}, {'sync' if args.sync else 'async'} server")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(histories, args, name):
    """Table, speed-up, plot and the accuracy check; the exit status."""
    path = plot(histories, args, name)
    print("\nworkers  threads each  train time (s)  time/epoch (s)  final val acc")
    for h in histories:
        train_s = sum(h["epoch_s"])
        print(f"{h['n']:>7d}  {h['threads']:>12d}  {train_s:14.2f}  {train_s / len(h['epoch_s']):14.3f}"
              f"  {h['val_acc'][-1]:13.2%}")
    final = histories[-1]
    if len(histories) > 1:
        # epoch 1 is left out of the median: it includes first-call overheads
        base, par = (np.median(h["epoch_s"][1:] or h["epoch_s"]) for h in histories)
        total_base, total_par = (sum(h["epoch_s"]) for h in histories)
        print(f"speed-up of {final['n']} workers over 1: {base / par:.2f}x (median epoch time), "
              f"{total_base / total_par:.2f}x (total training time)")
        print(f"(the 1-worker run used {_threads(histories[0]['threads'])}, each of the {final['n']} "
              f"workers {_threads(final['threads'])}; the figure depends on what else runs on the machine)")
    print(f"loss curves: {path}")
    ok = final["val_acc"][-1] >= TARGET_ACCURACY
    print(f"validation accuracy with {final['n']} workers: {final['val_acc'][-1]:.2%} "
          f"({'reached' if ok else 'BELOW'} the {TARGET_ACCURACY:.0%} target)", flush=True)
    return 0 if ok else 1


def main(doc, script, train, set_threads, threads_of="threads", argv=None):
    """A demo's whole run: ``train(args, data)`` on every worker (after
    ``set_threads(n)``), the 1-worker baseline first, the report on the
    master; returns the exit status. ``doc`` and ``script`` are the demo's
    docstring and file."""
    args = parse_args(doc.split("\n\n")[0], argv, threads_of)
    if args.freq < 1:
        sys.exit(f"--freq must be at least 1, got {args.freq}")
    data = load_data(args.seed)
    first = [] if args.no_baseline or mv.under_launcher() or args.workers == 1 else [baseline(args, script)]
    mv.init(sync=args.sync, num_workers=None if mv.under_launcher() else args.workers)
    set_threads(args.threads)
    if mv.is_master_worker() and not first:
        print(f"digits: {len(data[0])} training and {len(data[1])} validation images; "
              f"{mv.workers_num()} workers, batch {args.batch_size}, {args.epochs} epochs", flush=True)
    history = train(args, data)
    status = 0
    if mv.is_master_worker():
        if args.history:
            with open(args.history, "w") as fh:
                json.dump(history, fh)
        else:
            status = report(first + [history], args, os.path.splitext(os.path.basename(script))[0])
    mv.shutdown()
    return status
