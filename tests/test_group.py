"""The process group under the runtime and the parameter server (synkhronos/_procs/).

``synk.fork()`` and ``multiverso.init()`` share one group: the same
parent-death signal, the same lock file (so a run killed outright has its
names reclaimed, whichever started it), the same launcher switch and the
same waits. Each test here runs real processes.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytensor.tensor as pt
import pytest
from conftest import MODE
from pytensor import wrap_py

import synkhronos as synk
from mv.runner import run
from synkhronos._procs import children, launch, lease, waits

pytestmark = pytest.mark.timeout(120)


def _pdeathsig() -> int:
    import ctypes

    got = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
    return got.value


@wrap_py(itypes=[pt.dvector], otypes=[pt.lvector])
def _pdeathsig_op(x):
    return np.full(len(x), _pdeathsig(), dtype=np.int64)


def test_parent_death_signal_is_the_same_for_both(fork):
    """A fork's workers and a multiverso run's children arm one signal: children.PARENT_DEATH_SIGNAL."""
    fork(3)
    x = pt.dvector("x")
    f = synk.function([x], (_pdeathsig_op(x), "gather"), mode=MODE)
    synk.distribute()
    got = f(np.zeros(3))
    assert got.tolist()[1:] == [int(children.PARENT_DEATH_SIGNAL)] * 2, got  # rank 0 is the master
    synk.close()

    r = run(["pdeathsig", 3])
    assert r.rc == 0, r.output[-3000:]
    seen = {int(rank): int(sig) for rank, sig in re.findall(r"PDEATHSIG rank (\d+) (\d+)", r.output)}
    assert seen == {0: 0, 1: int(children.PARENT_DEATH_SIGNAL), 2: int(children.PARENT_DEATH_SIGNAL)}, r.output
    assert r.leftovers == [] and r.stragglers == []


def test_killed_multiverso_run_is_reclaimed():
    """Every process of an mv.init() run SIGKILLed: its names stay, with the group's lock
    file, until the next start on the machine reclaims them, as for a killed fork."""
    script = Path(__file__).resolve().parent / "mv" / "scenarios.py"
    _killed_then_reclaimed([sys.executable, str(script), "fault_kill_all", "3"])


def test_killed_fork_is_reclaimed(tmp_path):
    """The same for synk.fork(): a script's master and workers SIGKILLed at once."""
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, sys, synkhronos as synk\n"
        "synk.fork(2, device='cpu')\n"
        "print('PREFIX', synk._runtime.running_session().proc.prefix, flush=True)\n"
        "sys.stdin.readline()\n"
        "os.killpg(os.getpgid(0), signal.SIGKILL)\n")
    _killed_then_reclaimed([sys.executable, str(script)])


def _killed_then_reclaimed(cmd: list[str]) -> None:
    """``cmd`` prints ``PREFIX <its names' prefix>``, then waits for a line on its stdin
    before it SIGKILLs its whole group: it leaves its names, the lock file among them, and
    lease.unlink_stale() removes them once the group is gone.

    Every fork's start reclaims the stale names of the whole machine, so under
    pytest-xdist another test's fork could take them before this test looks: the test
    holds the group's lock file (as a live process of the group would) from before the
    kill until it has seen what was left."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    held, seen = None, []
    try:
        for line in proc.stdout:
            seen.append(line)
            found = re.search(r"PREFIX (synk\.\d+\.[0-9a-f]+\.)", line)
            if found:
                break
        else:
            raise AssertionError(f"no prefix printed (exit {proc.wait()}):\n{''.join(seen)[-3000:]}")
        prefix = found.group(1)
        held = os.open(f"/dev/shm/{prefix}lock", os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)
        proc.stdin.write("kill\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, out[-3000:]
        left = [n for n in os.listdir("/dev/shm") if prefix in n]
        assert prefix + "lock" in left and len(left) > 1, f"a run killed outright removed its names: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if held is not None:
            os.close(held)
    deadline = time.monotonic() + 10  # until the children, killed with the master, are gone
    while [n for n in os.listdir("/dev/shm") if prefix in n] and time.monotonic() < deadline:
        lease.unlink_stale()
        time.sleep(0.05)
    assert not [n for n in os.listdir("/dev/shm") if prefix in n]


def test_nodes_switch_keeps_multiverso_to_one_machine():
    """SYNKHRONOS_NODES=0 under a launcher's environment: mv.init() forks, as synk.fork() does."""
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "PMI_SIZE": "2",
           launch.SWITCH: "0"}
    r = run(["tables", 2], env=env)
    assert r.rc == 0, r.output[-3000:]
    assert sorted(re.findall(r"PASS tables rank (\d+) of 2", r.output)) == ["0", "1"], r.output[-3000:]
    assert r.leftovers == [] and r.stragglers == []


def test_multiverso_group_sigterm():
    """SIGTERM to the whole process group of an mv.init() run: it dies of it, nothing left."""
    r = run(["fault_term_group", 3])
    assert r.rc == -signal.SIGTERM, r.output[-3000:]
    assert r.leftovers == [] and r.stragglers == []


# -- the helpers themselves -------------------------------------------------------


def test_wait_until_times_out_and_checks():
    checks = []
    start = time.monotonic()
    assert not waits.wait_until(lambda: False, lambda: checks.append(1), timeout=0.2, check_every=0.01)
    assert 0.2 <= time.monotonic() - start < 2.0
    assert len(checks) >= 5

    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    assert waits.wait_until(flag.is_set, timeout=5.0)

    def boom():
        raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        waits.wait_until(lambda: False, boom, check_every=0.01)


def test_children_reap_signal_and_end():
    kids = children.Children()
    for rank in (1, 2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            if rank == 1:
                os._exit(3)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs SIGKILL
            time.sleep(60)
            os._exit(0)
        kids.pids[rank] = pid
    assert waits.wait_until(lambda: 1 in kids.exited or bool(kids.reap()) and 1 in kids.exited, timeout=10)
    assert kids.exited[1] == 3
    with pytest.raises(synk.WorkerDiedError, match="worker rank 1 died"):
        kids.poll()
    assert list(kids.alive()) == [2]
    start = time.monotonic()
    kids.end(0.1)
    assert kids.exited[2] == -signal.SIGKILL
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("start", ["synk.fork(1, device='cpu')", "mv.init(num_workers=1)"])
def test_launcher_without_mpi4py_says_what_to_do(start):
    """Under a launcher without mpi4py, fork() and mv.init() say what to install and how
    to run each copy on its own (it was a bare ModuleNotFoundError)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import synkhronos as synk, synkhronos.multiverso as mv\n"
            f"try:\n    {start}\nexcept ImportError as err:\n    print('ERR', err)\n"
            "synk.close()\n")
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    env.pop(launch.SWITCH, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env)
    assert "ERR synkhronos: an MPI launcher started this process" in out.stdout, out.stdout + out.stderr
    assert "synkhronos[mpi]" in out.stdout and f"{launch.SWITCH}=0" in out.stdout, out.stdout
