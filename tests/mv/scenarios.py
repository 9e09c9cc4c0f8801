"""Scenarios of synkhronos.multiverso, run as scripts (the SPMD model: every worker runs it).

    python scenarios.py SCENARIO NUM_WORKERS [TOKEN]
    mpirun -np N python scenarios.py SCENARIO 0 [TOKEN]

Every worker checks its own results and raises on the first wrong one (so
the exit status says it all); each prints ``PASS <scenario> rank <r> of <n>``
at the end. The fault scenarios fail on purpose; tests/test_multiverso.py
reads their output. TOKEN only marks the processes, so that the test can
look for any left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import synkhronos.multiverso as mv  # noqa: E402
from synkhronos._procs import launch  # noqa: E402
from synkhronos.errors import SynkError  # noqa: E402


def check(cond, what):
    if not cond:
        raise AssertionError(f"worker {mv.worker_id()}: {what}")


def raises(exc, fragment, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as err:
        check(fragment in str(err), f"{exc.__name__} without {fragment!r}: {err}")
        return
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"expected {exc.__name__} ({fragment}), got {type(err).__name__}: {err}")
    raise AssertionError(f"expected {exc.__name__} ({fragment}), nothing raised")


# -- Multiverso's own tests (binding/python/multiverso/tests/test_multiverso.py) ---------

def array_test(size, rounds=100):
    n = mv.workers_num()
    tbh = mv.ArrayTableHandler(size)
    mv.barrier()
    for i in range(rounds):
        tbh.add(range(1, size + 1))
        tbh.add(range(1, size + 1))
        mv.barrier()
        got = tbh.get()
        check(got.shape == (size,) and got.dtype == np.float32, f"array get: {got.shape} {got.dtype}")
        expected = np.arange(1, size + 1) * (i + 1) * 2 * n
        check(np.array_equal(got, expected), f"array round {i}: {got[:5]} != {expected[:5]}")
        mv.barrier()


def matrix_test():
    num_row, num_col = 11, 10
    size = num_row * num_col
    n = mv.workers_num()
    tbh = mv.MatrixTableHandler(num_row, num_col)
    mv.barrier()
    row_ids = [0, 1, 5, 10]
    base = np.arange(size).reshape(num_row, num_col)
    for count in range(1, 21):
        tbh.add(range(size))
        tbh.add([range(rid * num_col, (1 + rid) * num_col) for rid in row_ids], row_ids)
        mv.barrier()
        data = tbh.get()
        mv.barrier()
        expected = base * count * n
        expected[row_ids] *= 2
        check(np.array_equal(data, expected), f"matrix round {count}: {data} != {expected}")
        data = tbh.get(row_ids)
        mv.barrier()
        check(np.array_equal(data, base[row_ids] * count * n * 2), f"matrix rows round {count}")
    # random rows, repeated and out of order, against the whole table (no add meanwhile)
    whole = tbh.get()
    rng = np.random.default_rng(mv.worker_id())
    for k in range(20):
        ids = rng.integers(0, num_row, int(rng.integers(0, 30)))
        check(np.array_equal(tbh.get(ids), whole[ids]), f"random rows {ids}")
    mv.barrier()


def tables():
    n, me = mv.workers_num(), mv.worker_id()
    if not mv.under_launcher():
        check("mpi4py" not in sys.modules, "mpi4py was imported without a launcher")
    array_test(10000)
    matrix_test()
    array_test(1, rounds=20)                      # size 1 (Multiverso issue 69)
    if n > 1:
        array_test(n - 1, rounds=5)               # fewer values than workers
    # master's init_value wins; float64 on request; out=
    t = mv.ArrayTableHandler(3, init_value=np.array([1.5, 2.5, 3.5]) + 100 * me, dtype=np.float64)
    mv.barrier()
    out = np.zeros(3)
    check(t.get(out=out) is out and np.array_equal(out, [1.5, 2.5, 3.5]), f"init value: {out.tolist()}")
    check(t.dtype == np.float64, "float64 table")
    mv.barrier()
    t.add(np.full(3, 2.0 ** -40), sync=True)       # float64 keeps what float32 would lose
    mv.barrier()
    check(np.array_equal(t.get(), np.array([1.5, 2.5, 3.5]) + n * 2.0 ** -40), "float64 precision")
    m = mv.MatrixTableHandler(4, 3, init_value=np.arange(12.0).reshape(4, 3) * (me + 1))
    mv.barrier()
    check(np.array_equal(m.get(), np.arange(12).reshape(4, 3)), "matrix init value")
    mv.barrier()
    m.add(np.ones(6), row_ids=[3, 3])               # a repeated row receives both rows
    m.add(np.full((1, 3), 2.0), row_ids=[1])
    mv.barrier()
    got = m.get()
    exp = np.arange(12.0).reshape(4, 3)
    exp[3] += 2 * n
    exp[1] += 2 * n
    check(np.array_equal(got, exp), f"duplicate rows: {got} != {exp}")
    check(np.array_equal(m.get([3, 0, 3]), exp[[3, 0, 3]]), "rows in the order given, repeats")
    check(m.get([]).shape == (0, 3), "no rows")
    out = np.empty(12, dtype=np.float32)
    check(m.get(out=out) is out and np.array_equal(out, exp.reshape(-1)), "flat out")
    mv.barrier()
    errors(m, t)
    mv.barrier()


def errors(m, t):
    raises(ValueError, "has 4 values", t.add, np.ones(4))
    raises(TypeError, "real numbers", t.add, np.array(["a", "b", "c"]))
    raises(TypeError, "real numbers", t.add, np.ones(3, dtype=complex))
    raises(TypeError, "data is None", t.add, None)
    raises(IndexError, "row id 4 is out of range", m.add, np.ones(3), row_ids=[4])
    raises(IndexError, "row id -1 is out of range", m.get, [-1])
    raises(TypeError, "row_ids must be ints", m.get, [0.5])
    raises(ValueError, "2 row ids of 3 columns need 6", m.add, np.ones(3), row_ids=[0, 1])
    # the right size in the wrong shape (a transposed matrix), and a bool taken for a row id
    raises(ValueError, "data has shape (3, 4) but", m.add, np.ones((3, 4)))
    raises(ValueError, "data has shape (3, 2) but", m.add, np.ones((3, 2)), row_ids=[0, 1])
    raises(TypeError, "True and False are not row ids", m.add, np.ones((2, 3)), row_ids=[1, True])
    raises(TypeError, "True and False are not row ids", m.get, [True])
    raises(TypeError, "out has dtype float64", m.get, out=np.zeros((4, 3)))
    raises(ValueError, "out has shape (3, 3)", m.get, out=np.zeros((3, 3), dtype=np.float32))
    raises(TypeError, "dtype must be float32 or float64", mv.ArrayTableHandler, 3, dtype=np.int32)
    raises(ValueError, "size must be at least 1", mv.ArrayTableHandler, 0)
    raises(TypeError, "num_col must be an int", mv.MatrixTableHandler, 2, 2.0)
    raises(ValueError, "holds 6 values", mv.ArrayTableHandler, 6, init_value=np.ones(5))
    if launch.launched():  # under MPI (not switched off): one call's counts are C ints
        raises(ValueError, "at most 2,147,483,647 values a table", mv.MatrixTableHandler, 2 ** 16, 2 ** 15 + 1)
    raises(SynkError, "already called", mv.init)


def shapes():
    """Tables constructed differently on different workers: a clear error on every one."""
    mv.ArrayTableHandler(5 + mv.worker_id())


def arraylike():
    """PyTorch tensors (plain, needing grad) and objects with __array__ (as JAX arrays) as data."""
    import torch

    n = mv.workers_num()

    class Jaxish:  # what JAX arrays offer numpy
        def __array__(self, dtype=None, copy=None):
            return np.full(4, 2.0, dtype=dtype or np.float32)

    t = mv.ArrayTableHandler(4)
    m = mv.MatrixTableHandler(3, 4, dtype=np.float64)
    mv.barrier()
    t.add(torch.ones(4))
    t.add(torch.ones(2, 2, dtype=torch.float64, requires_grad=True))
    t.add(Jaxish())
    m.add(torch.arange(12.0).reshape(3, 4))
    m.add(torch.ones(1, 4), row_ids=torch.tensor([2]))
    mv.barrier()
    check(np.array_equal(t.get(), np.full(4, 4.0 * n)), f"tensors: {t.get()}")
    exp = np.arange(12.0).reshape(3, 4) * n
    exp[2] += n
    check(np.array_equal(m.get(), exp), f"matrix tensors: {m.get()}")
    mv.barrier()


def torch_manager():
    """TorchParamManager: the master's initial weights everywhere, then summed changes."""
    import torch

    from synkhronos.multiverso.torch_ext import TorchParamManager

    n, me = mv.workers_num(), mv.worker_id()
    torch.manual_seed(me)                            # different initial weights per worker
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    pm = TorchParamManager(model, buffers=True)
    start = [p.detach().clone() for p in model.parameters()]
    first = torch.tensor(pm.all_param_list[:6]).reshape(2, 3)
    check(torch.equal(model[0].weight.detach(), first), "weights set from the table")
    mv.barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    pm.sync_all_param()
    mv.barrier()
    pm.sync_all_param()
    for p, s0 in zip(model.parameters(), start):
        check(torch.allclose(p.detach(), s0 + n), "every worker's +1 summed")
    # every worker holds the master's start: compare with worker 0's through a table
    t = mv.ArrayTableHandler(6)
    if me == 0:
        t.add(model[0].weight.detach().reshape(-1))
    mv.barrier()
    check(np.allclose(t.get(), model[0].weight.detach().reshape(-1).numpy()), "same weights")
    raises(TypeError, "needs a torch.nn.Module", TorchParamManager, [1, 2])


# -- sync server -------------------------------------------------------------------------

def sync():
    n, me = mv.workers_num(), mv.worker_id()
    rounds = 30
    last = n - 1
    mine = rounds // 2 if (me == last and n > 1) else rounds   # the last worker finishes early
    size = 50
    t = mv.ArrayTableHandler(size, dtype=np.float64)
    contrib = lambda r, k: (r + 1) * 1000.0 + k + np.arange(size)  # noqa: E731
    rng = np.random.default_rng(me)
    for k in range(mine):
        t.add(contrib(me, k))
        time.sleep(rng.uniform(0, 0.003))           # workers drift apart
        got = t.get()
        exp = sum(contrib(r, j) for r in range(n) for j in range(min(k + 1, rounds // 2)
                                                                  if (r == last and n > 1) else k + 1))
        check(np.array_equal(got, exp), f"sync get {k}: {got[:3]} != {exp[:3]}")
    mv.shutdown()


# -- no update lost ------------------------------------------------------------------------

def stress():
    n, me = mv.workers_num(), mv.worker_id()
    big = mv.ArrayTableHandler(300_000, dtype=np.float64)       # many stripes
    small = mv.ArrayTableHandler(100)                             # one stripe: every add contends
    mat = mv.MatrixTableHandler(500, 64, dtype=np.float64)
    mv.barrier()
    rng = np.random.default_rng(me)
    ones = np.ones(300_000)
    rows_added = np.zeros(500)
    for k in range(60):
        big.add(ones)
        small.add(np.ones(100, dtype=np.float32))
        ids = rng.integers(0, 500, size=40)
        mat.add(np.ones((40, 64)), row_ids=ids)
        np.add.at(rows_added, ids, 1)
    done = mv.ArrayTableHandler(500, dtype=np.float64)          # each worker's row counts, summed
    done.add(rows_added)
    mv.barrier()
    total = done.get()
    check(np.array_equal(big.get(), np.full(300_000, 60.0 * n)), "big table lost an update")
    check(np.array_equal(small.get(), np.full(100, 60.0 * n)), "small table lost an update")
    check(np.array_equal(mat.get(), np.repeat(total[:, None], 64, axis=1)), "matrix lost an update")


# -- faults ----------------------------------------------------------------------------------

def fault_raise():
    t = mv.ArrayTableHandler(10)
    for i in range(3):
        t.add(np.ones(10))
        mv.barrier()
    if mv.worker_id() == mv.workers_num() - 1:
        raise ValueError(f"boom from worker {mv.worker_id()}")
    mv.barrier()
    raise AssertionError("the barrier after a failure returned")


def fault_kill():
    t = mv.ArrayTableHandler(10)
    mv.barrier()
    if mv.worker_id() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t.add(np.ones(10))
    t.get()
    mv.barrier()
    raise AssertionError("the barrier after a death returned")


def fault_kill_master():
    mv.barrier()
    if mv.worker_id() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    raise AssertionError("a worker outlived its master")


def fault_term_master():
    """Rank 0 gets SIGTERM after its workers ended their scripts: it still cleans up."""
    mv.barrier()
    if mv.worker_id() != 0:
        sys.exit(0)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    raise AssertionError("SIGTERM did not end rank 0")


def fault_term_group():
    """SIGTERM to the whole process group (a terminal, ``timeout``, a batch scheduler)
    while every rank works: rank 0 ends the others, removes everything, dies of it."""
    t = mv.ArrayTableHandler(10)
    mv.barrier()
    if mv.worker_id() == 0:
        os.killpg(os.getpgid(0), signal.SIGTERM)
    for _ in range(3000):
        t.add(np.ones(10))
        time.sleep(0.01)
    raise AssertionError("SIGTERM to the group did not end the run")


def _term_worker_1(step):
    """Rank 0 sends SIGTERM to rank 1 while both run ``step`` in a loop; rank 0 must raise
    WorkerFailedError naming the signal within a second of it, whatever lock rank 1 held."""
    import threading

    from synkhronos import _state as state

    mv.barrier()
    sent = []
    if mv.worker_id() == 0:
        pid = state.multiverso_server().world.children.pids[1]

        def term():
            sent.append(time.monotonic())
            os.kill(pid, signal.SIGTERM)

        threading.Timer(0.3, term).start()
    end = time.monotonic() + 20
    try:
        while time.monotonic() < end:
            step()
    except mv.WorkerFailedError as err:
        if sent:
            print(f"NOTICED after {time.monotonic() - sent[0]:.2f} s: {err}", flush=True)
        raise
    raise AssertionError("the SIGTERMed worker was not noticed")


def fault_term_add():
    t = mv.ArrayTableHandler(2_000_000)
    ones = np.ones(2_000_000, np.float32)
    _term_worker_1(lambda: t.add(ones))


def fault_term_row():
    t = mv.MatrixTableHandler(1, 2_000_000)  # one row, larger than a stripe: one lock per add
    ones = np.ones((1, 2_000_000), np.float32)
    _term_worker_1(lambda: t.add(ones))


def fault_term_barrier():
    _term_worker_1(mv.barrier)


def fault_kill_all():
    """Every process of the run SIGKILLed at once: nothing can clean up; what it leaves
    is reclaimed by the next init() or synk.fork() (lease.unlink_stale)."""
    mv.ArrayTableHandler(10)
    mv.barrier()
    from synkhronos import _state as state

    print(f"PREFIX {state.multiverso_server().world.prefix}", flush=True)
    if mv.worker_id() == 0:
        sys.stdin.readline()  # the test holds the group's lock file first (see test_group.py)
    mv.barrier()
    if mv.worker_id() == 0:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    time.sleep(30)
    raise AssertionError("SIGKILL to the group did not end the run")


def pdeathsig():
    """Every rank prints the signal it gets when its parent dies (0: none armed)."""
    import ctypes

    got = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
    print(f"PDEATHSIG rank {mv.worker_id()} {got.value}", flush=True)


def fault_sync_get():
    """A worker fails while the others wait for it in a sync get."""
    t = mv.ArrayTableHandler(10)
    t.add(np.ones(10))
    t.get()
    if mv.worker_id() == 1:
        raise RuntimeError("failed before the second get")
    t.add(np.ones(10))
    t.get()
    raise AssertionError("a sync get returned without worker 1")


def deadlock():
    """Sync server, workers calling different things: every one raises, none hangs."""
    a = mv.ArrayTableHandler(3)
    b = mv.ArrayTableHandler(3)
    a.add(np.ones(3))
    a.get()
    if mv.worker_id() == 0:
        a.get()          # waits for the others' second get of a
    elif mv.worker_id() == 1:
        mv.barrier()     # waits for the others in a barrier
    else:
        b.get()
    raise AssertionError("a deadlocked call returned")


def fault_early_exit():
    """A worker ends its script without shutdown() while the others wait in a barrier."""
    mv.barrier()
    if mv.worker_id() == 1:
        sys.exit(0)
    mv.barrier()
    raise AssertionError("a barrier returned without worker 1")


def not_initialised():
    raises(SynkError, "before multiverso.init()", mv.barrier)
    raises(SynkError, "before multiverso.init()", mv.ArrayTableHandler, 3)
    raises(SynkError, "before multiverso.init()", mv.worker_id)
    mv.init(num_workers=2)
    t = mv.ArrayTableHandler(3)
    mv.shutdown()
    raises(SynkError, "after multiverso.shutdown()", t.add, np.ones(3))
    raises(SynkError, "after multiverso.shutdown()", mv.barrier)
    raises(SynkError, "after multiverso.shutdown()", mv.shutdown)


# -- PyTensor helpers -------------------------------------------------------------------------

def sharedvar(rounds=100):
    """Multiverso's shared-variable test (200 x 200, W + arange twice per round), plus
    mv_sync() on the variable itself and the param managers."""
    import pytensor

    from synkhronos.multiverso.pytensor_ext import SharedVarParamManager, mv_shared
    from synkhronos.multiverso.theano_ext import sharedvar as sv  # the ported import

    n, me = mv.workers_num(), mv.worker_id()
    row, col = 200, 200
    W = mv_shared(value=np.zeros((row, col), dtype=pytensor.config.floatX), name="W", borrow=True)
    delta = np.arange(1, row * col + 1, dtype=pytensor.config.floatX).reshape((row, col))
    train_model = pytensor.function([], updates=[(W, W + delta)], mode="FAST_COMPILE")
    mv.barrier()
    for i in range(rounds):
        train_model()
        train_model()
        sv.sync_all_mv_shared_vars()
        mv.barrier()
        sv.sync_all_mv_shared_vars()                # to get the newest value, sync again
        check(np.array_equal(W.get_value().reshape(-1), np.arange(1, row * col + 1) * (i + 1) * 2 * n),
              f"mv_shared round {i}")
        mv.barrier()
    # the master's initial value wins; W.mv_sync() works on what mv_shared returns
    b = mv_shared(np.full(3, 10.0 * (me + 1), dtype=np.float32), name="b")
    check(np.array_equal(b.get_value(), [10.0] * 3) and b.get_value().dtype == np.float32, "b init")
    b.set_value(b.get_value() + me + 1)
    b.mv_sync()
    mv.barrier()
    b.mv_sync()
    check(np.array_equal(b.get_value(), [10.0 + n * (n + 1) / 2] * 3), f"b.mv_sync: {b.get_value()}")
    # a manager for a list of shared variables: ints, a scalar, float32
    k = pytensor.shared(np.arange(4, dtype=np.int64) * (me + 1), name="k")
    s = pytensor.shared(np.float64(me), name="s")
    f = pytensor.shared(np.ones((2, 2), dtype=np.float32), name="f")
    pm = SharedVarParamManager([k, s, f])
    check(np.array_equal(k.get_value(), np.arange(4)) and k.get_value().dtype == np.int64, "k init")
    check(s.get_value() == 0.0, "s init")
    for _ in range(3):
        k.set_value(k.get_value() + 1)
        s.set_value(s.get_value() + 0.5)
        f.set_value(f.get_value() * 1)              # no change
        pm.sync_all_param()
    mv.barrier()
    pm.sync_all_param()
    check(np.array_equal(k.get_value(), np.arange(4) + 3 * n), f"manager ints: {k.get_value()}")
    check(s.get_value() == 1.5 * n, f"manager scalar: {s.get_value()}")
    check(np.array_equal(f.get_value(), np.ones((2, 2))), "manager float32")
    raises(TypeError, "needs PyTensor shared variables", SharedVarParamManager, [np.zeros(2)])
    # a variable whose shape changed: an error naming it and both shapes (it was NumPy's)
    b.set_value(np.zeros(4, dtype=np.float32))
    raises(ValueError, "b has shape (4,) but its table was made for shape (3,)", b.mv_sync)


def async_all():
    """tables, stress and sharedvar in one run (one mpirun start instead of three)."""
    tables()
    stress()
    sharedvar()


def torch_all():
    arraylike()
    torch_manager()


SCENARIOS = {f.__name__: f for f in (
    tables, stress, sharedvar, async_all, sync, shapes, deadlock, arraylike, torch_manager,
    torch_all, fault_raise, fault_kill, fault_kill_master, fault_term_master, fault_sync_get,
    fault_early_exit, fault_term_group, fault_kill_all, pdeathsig, fault_term_add, fault_term_row,
    fault_term_barrier)}


def main():
    name, n = sys.argv[1], int(sys.argv[2])
    if name == "not_initialised":
        not_initialised()
        print(f"PASS {name} rank {mv.worker_id()} of {mv.workers_num()}", flush=True)
        return
    if name in ("arraylike", "torch_manager", "torch_all"):
        import torch  # noqa: F401 - once, before the fork, not in every worker
    mv.init(sync=name in ("sync", "fault_sync_get", "deadlock"), num_workers=n or None)
    SCENARIOS[name]()
    print(f"PASS {name} rank {mv.worker_id()} of {mv.workers_num()}", flush=True)
    if name != "sync":
        mv.shutdown()


if __name__ == "__main__":
    main()
