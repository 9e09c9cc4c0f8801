"""Fixtures: fork 1, 2 or 3 processes, close afterwards, and check nothing leaked."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

#: The suite runs more processes than the machine has cores (pytest-xdist's workers,
#: each test's forked workers, mpirun's nodes), and OpenBLAS's threads spin for about
#: 2^28 cycles (a tenth of a second) before they sleep: on 2 cores the spinning threads
#: of one test took the cores from the others (the headline demo's test took 140 s in
#: the suite against 12 s alone, the whole main suite 8:37 against 6:15 with this).
#: The shortest spin OpenBLAS allows (2^4 cycles), read when it loads: before numpy,
#: here and in every process the tests start. What runs is unchanged; only how long an
#: idle BLAS thread keeps its core. A value set by the caller is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import numpy as np  # noqa: E402
import pytest

import synkhronos as synk
from synkhronos._batching import split

#: A shell without job control starts a background command (``make test &``)
#: with SIGINT and SIGQUIT ignored, ``nohup`` with SIGHUP ignored, and a process
#: keeps an ignored signal across exec. The signal tests, here and in the scripts
#: they start, expect each signal's default action, as from a terminal: with one
#: ignored they would wait for a death or a KeyboardInterrupt that never comes
#: (they did, under ``nohup``). So the suite runs with the defaults (Python's
#: handler for SIGINT; a child started after exec gets the default action).
for _sig, _default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL),
                       (signal.SIGHUP, signal.SIG_DFL)):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _default)

#: Compile fast; the tests are about the runtime, not about PyTensor's optimiser.
MODE = "FAST_COMPILE"
SHM_DIR = "/dev/shm"


def run_python(code: str, pythonpath=(), timeout: float = 120, **env) -> subprocess.CompletedProcess:
    """``code`` (dedented) in a new Python, from the repository's root, with ``pythonpath``
    first on its path and ``env`` added to this process's environment."""
    paths = [str(p) for p in pythonpath] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parent.parent, env=full_env)


def shm_names() -> list[str]:
    """Shared-memory segments and semaphores of synkhronos forks made by this process.

    Every name a fork creates (its workers' included) starts with the master's
    prefix ``synk.<master pid>.``; restricting the check to our pid keeps it
    correct when another test run shares the machine.
    """
    tag = f"synk.{os.getpid()}."
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(e for e in entries if e.startswith(tag) or e.startswith("sem." + tag))


def child_pids() -> list[int]:
    """Children of this process, zombies included (from /proc)."""
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as fh:
                pids += [int(p) for p in fh.read().split()]
        except OSError:
            pass
    return sorted(set(pids))


def has_unreaped_child() -> bool:
    """True if any child (running or zombie) is left; reaps a zombie it finds."""
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True


def worker_pids() -> dict[int, int]:
    """rank -> pid of the running fork's workers."""
    from synkhronos import _runtime as runtime

    return dict(runtime.running_session().watch.pids)


def rows_of(n_rows: int, n_parallel: int, rank: int) -> slice:
    """The rows rank ``rank`` computes when ``n_rows`` split over ``n_parallel``."""
    return slice(*split(n_rows, n_parallel, rank))


def read_pids_and_prefix(stream) -> tuple[list[int], str | None]:
    """From a child script's output: the worker pids it printed after ``PIDS`` and
    the fork's name prefix after ``PREFIX`` (read up to that line)."""
    pids, prefix = [], None
    for line in stream:
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
        if line.startswith("PREFIX"):
            prefix = line.split()[1]
            break
    return pids, prefix


def _force_cleanup(leaked_names, leaked_pids) -> None:
    """After a failed leak check: don't let the leak poison the next tests."""
    from synkhronos._procs.shmem import unlink_prefix

    for pid in leaked_pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.01)
    for name in leaked_names:
        unlink_prefix(name[4:] if name.startswith("sem.") else name)


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test starts and ends with no fork, no segment, no child process."""
    synk.close()
    assert shm_names() == [], "leftovers from an earlier test"
    yield
    synk.close()
    names, pids = shm_names(), child_pids()
    unreaped = has_unreaped_child()
    if names or pids or unreaped:
        _force_cleanup(names, pids)
    assert names == [], f"shared memory left in {SHM_DIR} after close(): {names}"
    assert pids == [], f"child processes left after close(): {pids}"
    assert not unreaped, "an unreaped child process was left after close()"


@pytest.fixture
def fork():
    """Factory: ``fork(n_parallel, **kw)`` starts a fork; it is closed after the test."""

    def _fork(n_parallel: int = 2, **kwargs) -> int:
        with warnings.catch_warnings():
            # 3 processes on a 2-core machine warn; that is tested on its own
            warnings.simplefilter("ignore", UserWarning)
            n = synk.fork(n_parallel, device="cpu", **kwargs)
        assert n == n_parallel
        assert len(worker_pids()) == n_parallel - 1
        return n

    yield _fork
    synk.close()


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"n{n}")
def n_parallel(request) -> int:
    return request.param


@pytest.fixture
def forked(fork, n_parallel) -> int:
    """A running fork of ``n_parallel`` processes (1, 2 and 3)."""
    return fork(n_parallel)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


_OWN_FILES = ("test_function.py", "test_data.py", "test_errors.py")


def pytest_collection_modifyitems(config, items):
    """A hung test in these files ends the run instead of blocking it forever.

    The thread method is needed: a SIGALRM that lands while a process sleeps
    on a POSIX semaphore is turned into posix_ipc.SignalError by posix_ipc
    (the handler's own exception is dropped), so the signal method can miss.
    """
    for item in items:
        if item.fspath.basename in _OWN_FILES and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(60, method="thread"))


def pytest_runtest_logreport(report):
    """With ``SYNK_FAILURES_LOG`` set (tests/gpu_validate.sh), each failure's traceback and
    captured output go to that file the moment it is reported (by the controller under
    pytest-xdist): a run that a time limit cuts short never prints its summary."""
    path = os.environ.get("SYNK_FAILURES_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    captured = "".join(f"---- {name} ----\n{text[-4000:]}\n" for name, text in report.sections)
    with open(path, "a") as fh:
        fh.write(f"==== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s) ====\n"
                 f"{report.longreprtext}\n{captured}\n")


def pytest_addoption(parser):
    """Options of tests/test_model.py (the model-based random test)."""
    parser.addoption("--soak", type=float, default=0,
                     help="test_model.py: run random seeds for this many seconds per process count "
                          "(0, the default: skip the soak test)")
    parser.addoption("--model-steps", type=int, default=0,
                     help="test_model.py: random steps per process count (0: the file's defaults)")
