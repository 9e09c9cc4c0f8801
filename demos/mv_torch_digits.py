"""Train a PyTorch MLP on scikit-learn's digits through a parameter-server table.

The PyTorch demo of ``synkhronos.multiverso``: every worker trains its own
copy of the model on its own share of the training images and, after every
``--freq`` minibatches, ``TorchParamManager.sync_all_param()`` adds its
change to one table holding all the parameters and loads the sum of every
worker's changes (Multiverso's delta rule; the successor of Lua Torch's
``model:getParameters()`` kept in an array table). It runs the same training
on one worker first (in a child process) and then on several, so the
speed-up over one worker is measured on this machine, and shows:

* ``mv.init()`` forking the workers (no launcher), every one running the
  rest of the script; ``mpirun -np 2 python demos/mv_torch_digits.py`` runs
  the same script on MPI ranks instead (then without the 1-worker run);
* a progress bar per epoch, validation accuracy, and a plot of the loss
  curves (``demos/results/mv_torch_digits.png``).

80% of the digits train, 20% validate; the training images are also used
shifted by one pixel up, down, left and right. Exits with status 1 if the
validation accuracy is below 93%. Needs ``pip install -e '.[torch,demo]'``.

Usage::

    python demos/mv_torch_digits.py                      # 1 worker, then one per core
    python demos/mv_torch_digits.py --workers 2 --epochs 5 --no-baseline
    mpirun -np 2 python demos/mv_torch_digits.py
"""

import sys
import time

import numpy as np
import torch
import torch._dynamo  # noqa: F401 - the first optimizer step imports it: once here, before the fork

import synkhronos.multiverso as mv
from synkhronos.multiverso.torch_ext import TorchParamManager
from mv_common import main as run  # noqa: E402 - shared by the two demos

# ---------------------------------------------------------------------------
# Model


def build(args):
    torch.manual_seed(args.seed + mv.worker_id())   # different on every worker: the master's wins
    return torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 10))


def progress(iterable, total, desc, enabled):
    # bars only on a terminal: redrawn into a log file they would fill it
    if not enabled or not sys.stdout.isatty():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, ncols=88, file=sys.stdout)


# ---------------------------------------------------------------------------
# One run: every worker runs this after mv.init()


def train(args, data):
    """Train on this worker's share, syncing through the table; the master's history."""
    x_train, x_val, y_train, y_val = (torch.from_numpy(a) for a in data)
    n, me = mv.workers_num(), mv.worker_id()
    mine = np.arange(me, len(x_train), n)            # this worker's share of the images
    model = build(args)
    pm = TorchParamManager(model)                     # every worker starts from the master's weights
    opt = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    order = np.random.default_rng(args.seed + 1 + me)
    n_batches = -(-len(mine) // args.batch_size)
    history = {"train_loss": [], "val_loss": [], "val_acc": [], "epoch_s": [], "n": n}
    steps = 0
    for epoch in range(1, args.epochs + 1):
        perm = order.permutation(mine)
        mv.barrier()
        t0 = time.perf_counter()
        total = 0.0
        bar = progress(range(n_batches), n_batches, f"{n} worker{'s' if n > 1 else ''}  "
                       f"epoch {epoch:2d}/{args.epochs}", me == 0 and not args.no_progress)
        for b in bar:
            idx = torch.from_numpy(perm[b * args.batch_size:(b + 1) * args.batch_size])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            steps += 1
            if steps % args.freq == 0:
                pm.sync_all_param()                  # add my change, load everyone's
            total += loss.item() * len(idx)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss.item():.4f}")
        mv.barrier()                                  # the epoch ends when every worker's share is done
        history["epoch_s"].append(time.perf_counter() - t0)
        if me == 0:
            with torch.no_grad():
                logits = model(x_val)
                history["val_loss"].append(torch.nn.functional.cross_entropy(logits, y_val).item())
                history["val_acc"].append((logits.argmax(1) == y_val).double().mean().item())
            history["train_loss"].append(total / len(mine))
            print(f"{n} worker{'s' if n > 1 else ' '}  epoch {epoch:2d}  train loss "
                  f"{history['train_loss'][-1]:.4f}  val loss {history['val_loss'][-1]:.4f}  val acc "
                  f"{history['val_acc'][-1]:.2%}  ({history['epoch_s'][-1]:.2f} s)", flush=True)
    history["threads"] = torch.get_num_threads()
    return history


def main(argv=None):
    return run(__doc__, __file__, train, torch.set_num_threads, "PyTorch threads", argv)


if __name__ == "__main__":
    sys.exit(main())
