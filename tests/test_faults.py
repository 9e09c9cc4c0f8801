"""Fault injection with real processes: errors come home, nothing hangs or leaks."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import posix_ipc
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor.sharedvar import TensorSharedVariable

import synkhronos as synk
from synkhronos import _runtime as runtime

MASTER_PID = os.getpid()
FAST = dict(mode="FAST_COMPILE")


def _ours(pid=None):
    """Synkhronos names in /dev/shm: every fork's, or only those of the fork that process
    ``pid`` started (another synkhronos run on the machine must not count as a leak)."""
    tag = "synk." if pid is None else f"synk.{pid}."
    return sorted(e for e in os.listdir("/dev/shm") if tag in e)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _wait_shm_clean(before, timeout=10.0, pid=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [e for e in _ours(pid) if e not in before]
        if not left:
            return []
        time.sleep(0.05)
    return left


from conftest import worker_pids as _worker_pids  # noqa: E402
from conftest import read_pids_and_prefix  # noqa: E402


# -- exceptions in workers ----------------------------------------------------


def test_worker_raises_in_function_keeps_type_rank_and_traceback(fork):
    fork(2)
    x = pt.dvector("x")
    checked = pytensor.raise_op.Assert("row sum too large")(x, pt.all(x < 100))
    f = synk.function([x], checked.sum(), **FAST)
    synk.distribute()
    data = np.array([1.0, 2.0, 500.0, 600.0])  # rank 1 gets the bad rows
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="row sum too large") as info:
        f(data)
    assert time.monotonic() - t0 < 5
    err = info.value
    assert getattr(err, "synk_rank", None) == 1
    assert isinstance(err.__cause__, synk.RemoteTraceback)
    assert "Traceback from worker rank 1" in str(err.__cause__)
    assert "AssertionError" in str(err.__cause__)
    # the runtime stays usable
    assert f(np.array([1.0, 2.0, 3.0, 4.0])) == pytest.approx(10.0 / 2)


class _FlakySharedVariable(TensorSharedVariable):
    """User code that fails only in workers, inside a collective."""

    def get_value(self, borrow=False, return_internal_type=False):
        if os.getpid() != MASTER_PID:
            raise RuntimeError(f"flaky get_value in pid {os.getpid()}")
        return super().get_value(borrow, return_internal_type)


def _flaky_shared(value, name):
    plain = pytensor.shared(value, name=name)
    return _FlakySharedVariable(type=plain.type, value=value, strict=False, name=name)


@pytest.mark.parametrize("n", [2, 3])
def test_worker_raises_in_collective(fork, n):
    fork(n)
    s = _flaky_shared(np.ones(3), "flaky")
    t = pytensor.shared(np.ones(3), name="t")
    x = pt.dvector("x")
    synk.function([x], (x.sum() + s.sum() + t.sum()), **FAST)
    synk.distribute()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="flaky get_value") as info:
        synk.all_reduce(s, op="sum")
    assert time.monotonic() - t0 < 5
    assert info.value.synk_rank in range(1, n)
    # every process is free again: another collective works
    synk.all_reduce(t, op="sum")
    assert np.allclose(synk.get_value(n - 1, t), n * np.ones(3))


class _FailsToUnpickle(Op):
    """An Op that pickles in the master but cannot be rebuilt in a worker."""

    __props__ = ()

    def make_node(self, x):
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = inputs[0].copy()

    def __reduce__(self):
        return (_rebuild_op, ())


def _rebuild_op():
    if os.getpid() != MASTER_PID:
        raise ValueError("this op cannot be rebuilt in a worker")
    return _FailsToUnpickle()


def test_worker_raises_in_distribute(fork):
    fork(2)
    x = pt.dvector("x")
    good = synk.function([x], x.sum(), **FAST)
    synk.function([x], _FailsToUnpickle()(x).sum(), **FAST)
    with pytest.raises(ValueError, match="cannot be rebuilt in a worker") as info:
        synk.distribute()
    assert info.value.synk_rank == 1
    # the runtime is still usable for what did distribute
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        good(np.ones(4))  # good was in the same batch; it is sent again with the bad one


def test_unpicklable_function_fails_in_master(fork):
    fork(2)
    x = pt.dvector("x")
    f = synk.function([x], x.sum(), **FAST)
    f._spec.kwargs["unpicklable"] = threading.Lock()
    with pytest.raises(TypeError, match="could not pickle functions"):
        synk.distribute()
    f._spec.kwargs.pop("unpicklable")
    assert f(np.ones(4)) == pytest.approx(2.0)


# -- dead workers -------------------------------------------------------------


def test_worker_killed_between_calls(fork):
    fork(3)
    x = pt.dvector("x")
    f = synk.function([x], x.sum(), **FAST)
    synk.distribute()
    assert f(np.ones(6)) == pytest.approx(2.0)
    pid = _worker_pids()[2]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match=r"rank 2 died \(killed by signal SIGKILL\)") as info:
        f(np.ones(6))
    assert time.monotonic() - t0 < 5
    assert info.value.rank == 2
    with pytest.raises(synk.SynkError, match="unusable"):
        f(np.ones(6))
    synk.close()
    # and a new fork works
    fork(2)
    g = synk.function([x], x.sum(), **FAST)
    assert g(np.ones(4)) == pytest.approx(2.0)


def test_worker_killed_during_call(fork):
    fork(2)
    x = pt.dmatrix("x")
    y = x
    for _ in range(30):
        y = pt.tanh(y.dot(x.T).dot(x) * 1e-6)
    f = synk.function([x], y.sum(), **FAST)
    synk.distribute()
    pid = _worker_pids()[1]
    timer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 1 died"):
        for _ in range(100):
            f(np.random.rand(600, 600))
    timer.join()
    assert time.monotonic() - t0 < 30


def test_worker_killed_during_collective_wait(fork):
    fork(2)
    s = pytensor.shared(np.ones(2), name="s")
    synk.function([], s.sum(), **FAST)
    synk.distribute()
    os.kill(_worker_pids()[1], signal.SIGKILL)
    with pytest.raises(synk.WorkerDiedError, match="rank 1"):
        synk.all_reduce(s)


# -- the master dying ---------------------------------------------------------

_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos import _runtime as runtime
    synk.fork(3, device="cpu")
    x = pt.dvector("x")
    f = synk.function([x], x.sum(), mode="FAST_COMPILE")
    f(np.ones(6))
    s = runtime.running_session()
    print("PIDS", " ".join(str(p) for p in s.watch.pids.values()), flush=True)
    print("PREFIX", s.proc.prefix, flush=True)
    how = sys.argv[1]
    if how == "close":
        synk.close()
    elif how == "raise":
        raise RuntimeError("uncaught in the master")
    elif how == "sleep":
        time.sleep(60)
""")


def _run_master(how, tmp_path, kill=False):
    script = tmp_path / "master.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids, prefix = read_pids_and_prefix(proc.stdout)
    if kill:
        proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, pids, prefix, err


@pytest.mark.parametrize("how", ["close", "exit", "raise", "sigkill"])
def test_master_exit_leaves_nothing(tmp_path, how):
    code, pids, prefix, err = _run_master("sleep" if how == "sigkill" else how, tmp_path,
                                          kill=how == "sigkill")
    assert len(pids) == 2 and prefix
    if how in ("close", "exit"):
        assert code == 0, err
    elif how == "raise":
        assert code == 1 and "uncaught in the master" in err
    else:
        assert code == -signal.SIGKILL
    assert _wait_gone(pids) == [], "orphan workers"
    end = time.monotonic() + 10
    while time.monotonic() < end and any(e.startswith(prefix) or e.startswith("sem." + prefix)
                                         for e in os.listdir("/dev/shm")):
        time.sleep(0.05)
    assert [e for e in os.listdir("/dev/shm") if prefix in e] == []


def test_fork_cleans_what_a_dead_master_left(fork):
    # A fork whose processes were all killed at the wrong moment: its segments
    # and its lock file outlive it, and nobody holds the lock any more.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = f"synk.{dead.pid}.0123456789abcdef."
    seg = posix_ipc.SharedMemory("/" + prefix + "ctl", posix_ipc.O_CREX, size=4096)
    seg.close_fd()
    sem = posix_ipc.Semaphore("/" + prefix + "done", posix_ipc.O_CREX)
    sem.close()
    open(f"/dev/shm/{prefix}lock", "x").close()
    assert any(prefix in e for e in os.listdir("/dev/shm"))
    fork(1)
    assert [e for e in os.listdir("/dev/shm") if prefix in e] == []


# -- Ctrl-C -------------------------------------------------------------------

_SIGINT_SCRIPT = textwrap.dedent("""
    import time
    import numpy as np
    import pytensor.tensor as pt
    import synkhronos as synk
    synk.fork(2, device="cpu")
    x = pt.dmatrix("x")
    y = x
    for _ in range(30):
        y = pt.tanh(y.dot(x.T).dot(x) * 1e-6)
    f = synk.function([x], y.sum(), mode="FAST_COMPILE")
    v = pt.dvector("v")
    g = synk.function([v], v.sum(), mode="FAST_COMPILE")
    synk.distribute()
    print("READY", flush=True)
    try:
        for _ in range(1000):
            f(np.random.rand(600, 600))
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    try:
        print("AFTER", float(g(np.ones(4))), flush=True)
    except Exception as e:
        print("UNUSABLE", type(e).__name__, flush=True)
    synk.close()
    print("CLOSED", flush=True)
""")


def test_sigint_during_long_call(tmp_path):
    script = tmp_path / "sigint.py"
    script.write_text(_SIGINT_SCRIPT)
    before = _ours()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "INTERRUPTED" in out
    assert "AFTER 2.0" in out
    assert "CLOSED" in out
    assert _wait_shm_clean(before, pid=proc.pid) == []


def test_shared_memory_is_private_and_unpredictable(fork):
    import stat

    fork(2)
    x = pt.dvector("x")
    synk.function([x], x.sum(), **FAST)(np.ones(4))
    d = synk.data(np.ones(3))
    from conftest import shm_names

    names = shm_names()
    assert names, "a fork makes segments and semaphores"
    for name in names:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode)
        assert mode == 0o600, f"{name} has mode {oct(mode)}"
    token = runtime.running_session().proc.prefix.split(".")[2]
    assert len(token) == 16 and int(token, 16) >= 0  # 64 random bits in every name
    assert all(token in name for name in names)
    del d
