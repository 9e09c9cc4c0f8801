"""synkhronos.multiverso with forked workers (no launcher): Multiverso's own tests, the sync
server, concurrency, bad inputs and faults.

Each case runs tests/mv/scenarios.py as a script (every worker runs the rest
of the script after ``mv.init()``), bounded by a timeout; the script checks
its results in every worker. Afterwards nothing may be left in /dev/shm under
the script's prefix, and no process of it may remain.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from mv.runner import HERE, run

pytestmark = pytest.mark.timeout(120)


def passed(r, name, n):
    assert r.rc == 0, f"exit status {r.rc}:\n{r.output[-4000:]}"
    ranks = sorted(int(m) for m in re.findall(rf"PASS {name} rank (\d+) of {n}", r.output))
    assert ranks == list(range(n)), f"PASS lines from ranks {ranks}:\n{r.output[-4000:]}"
    clean(r)


def clean(r):
    assert r.leftovers == [], f"left in /dev/shm: {r.leftovers}"
    assert r.stragglers == [], f"processes left: {r.stragglers}"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_multiverso_tables(n):
    """Multiverso's array (10,000 x 100 rounds) and matrix (11 x 10, row_ids) tests, size 1,
    sizes below the worker count, init values, float64, out=, duplicate row ids, bad inputs."""
    passed(run(["tables", n]), "tables", n)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_sync_server_gets_match_and_early_finish(n):
    """Every i-th get of every worker equals the sum of every add issued before it (so they
    all match); the last worker shuts down at half time and the others go on without it."""
    passed(run(["sync", n]), "sync", n)


@pytest.mark.parametrize("n, sync, seed", [(2, 0, 5101), (3, 1, 5102),
                                           pytest.param(4, 0, 5103, marks=pytest.mark.slow),
                                           pytest.param(4, 1, 5104, marks=pytest.mark.slow)],
                         ids=["two-async", "three-sync", "four-async", "four-sync"])
def test_tables_against_a_model(n, sync, seed):
    """tests/mv/model_tables.py: random tables (sizes of 1, fewer values or rows than
    workers, many stripes; float32 and float64; the master's init value), random adds of
    every worker (whole or by rows, repeated and out of order, data of any form, sync or
    not) and reads (whole, rows, out=), each compared bit for bit with a numpy model: a
    sync server's every get, an async server's between two barriers. SYNK_MODEL_SEED
    replaces the seed."""
    seed = int(os.environ.get("SYNK_MODEL_SEED", seed))
    passed(run([seed, 300, sync, n], script=HERE / "model_tables.py"), "model", n)


def test_concurrent_adds_lose_nothing():
    """Three workers add into a many-stripe table, a one-stripe table and random rows of a
    matrix without barriers; after one barrier the sums are exact."""
    passed(run(["stress", 3]), "stress", 3)


def test_calls_before_init_and_after_shutdown():
    passed(run(["not_initialised", 0]), "not_initialised", 2)


def test_different_tables_on_different_workers():
    r = run(["shapes", 3])
    assert r.rc != 0
    assert "every worker must construct the same tables in the same order" in r.output
    clean(r)


def failed(r):
    assert r.rc != 0, f"a failed run exited with status 0:\n{r.output[-3000:]}"
    assert "[runner: killed" not in r.output, f"the run hung:\n{r.output[-3000:]}"
    clean(r)


def test_worker_raises():
    r = run(["fault_raise", 3])
    failed(r)
    # the others name the rank, with the traceback where it raised
    assert "worker 2 of 3 raised ValueError: boom from worker 2 (seen by worker 0 in barrier())" in r.output
    assert "worker 2 of 3 raised ValueError: boom from worker 2 (seen by worker 1 in barrier())" in r.output
    assert "Traceback from worker 2:" in r.output and 'raise ValueError(f"boom' in r.output


def test_worker_killed():
    r = run(["fault_kill", 3])
    failed(r)
    assert re.search(r"worker 1 of 3 died \(.*\) \(seen by worker 0", r.output), r.output[-3000:]
    assert re.search(r"worker 1 of 3 died \(.*\) \(seen by worker 2", r.output), r.output[-3000:]


def test_master_killed():
    """Rank 0 killed: its workers end (parent-death signal) and the last one cleans up."""
    r = run(["fault_kill_master", 3])
    failed(r)


@pytest.mark.parametrize("scenario", ["fault_term_add", "fault_term_row", "fault_term_barrier"])
def test_worker_terminated_while_holding_a_lock(scenario):
    """SIGTERM to a worker looping on add (whole table, or one row larger than a stripe:
    it holds a table lock most of the time) or on barrier(): the other raises within a
    second, naming the signal. The others waited on the lock for ever (15 of 20 runs)."""
    r = run([scenario, 2], timeout=40)
    failed(r)
    m = re.search(r"NOTICED after ([0-9.]+) s: worker 1 of 2 died \(killed by signal SIGTERM\)", r.output)
    assert m, r.output[-3000:]
    assert float(m.group(1)) < 1.5, r.output[-3000:]


@pytest.mark.parametrize("n", [1, 3])
def test_master_terminated(n):
    """SIGTERM to rank 0 (after its workers ended): it removes everything, then dies of it."""
    r = run(["fault_term_master", n])
    assert r.rc == -15, f"exit status {r.rc}:\n{r.output[-3000:]}"
    clean(r)


def test_worker_raises_during_sync_get():
    r = run(["fault_sync_get", 3])
    failed(r)
    # worker 0 sees it in its second add or get (when it starts, or while it waits)
    assert "worker 1 of 3 raised RuntimeError: failed before the second get (seen by worker 0 in " \
        in r.output, r.output[-3000:]


def test_worker_ends_without_reaching_barrier():
    r = run(["fault_early_exit", 3])
    failed(r)
    assert "worker 1 of 3 ended its script and will never reach it" in r.output


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mv_shared_and_param_managers(n):
    """Multiverso's 200 x 200 mv_shared test (a PyTensor function adds arange twice per round,
    sync, barrier, sync), W.mv_sync() on what mv_shared returns, the master's initial value,
    the ported ``theano_ext.sharedvar`` import, and a manager for a list of shared variables."""
    passed(run(["sharedvar", n]), "sharedvar", n)


def accuracies(output):
    return [float(a) for a in re.findall(r"validation accuracy (\d\.\d+)", output)]


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                    reason="the example needs scikit-learn (pip install -e '.[demo]')")
def test_example_logistic_digits_forked():
    """examples/mv_logistic_digits.py with 2 forked workers reaches at least 93%."""
    from mv.runner import ROOT

    r = run([2], script=ROOT / "examples" / "mv_logistic_digits.py", timeout=150)
    assert r.rc == 0, r.output[-3000:]
    acc = accuracies(r.output)
    assert len(acc) == 15 and acc[-1] >= 0.93, r.output[-2000:]
    clean(r)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
def test_pytorch_tensors_as_data_and_torch_param_manager():
    """PyTorch tensors (plain, needing grad, as row ids) and __array__ objects as data; the
    TorchParamManager starts every worker from the master's weights and sums their changes."""
    passed(run(["torch_all", 2]), "torch_all", 2)


def test_data_is_copied_only_when_needed():
    """What add() hands to the table is the caller's memory unless a cast or a gather is needed."""
    import numpy as np

    from synkhronos.multiverso.tables import _values

    a = np.arange(6, dtype=np.float32)
    assert np.shares_memory(_values(a, np.float32, 6, "add", ""), a)
    assert np.shares_memory(_values(a.reshape(2, 3), np.float32, 6, "add", ""), a)
    cast = _values(np.arange(6.0), np.float32, 6, "add", "")
    assert cast.dtype == np.float32 and np.array_equal(cast, a)
    strided = np.arange(12, dtype=np.float32)[::2]
    assert np.array_equal(_values(strided, np.float32, 6, "add", ""), strided)
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32)
    assert np.shares_memory(_values(t, np.float32, 6, "add", ""), t.numpy())


def test_launcher_detection(monkeypatch):
    from synkhronos._procs.launch import LAUNCHER_VARS, SWITCH
    from synkhronos.multiverso import under_launcher

    monkeypatch.delenv(SWITCH, raising=False)
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not under_launcher()
    for var in LAUNCHER_VARS:
        monkeypatch.setenv(var, "2")
        assert under_launcher()
        monkeypatch.setenv(SWITCH, "0")  # as for synk.fork(): the copy keeps to itself
        assert not under_launcher()
        monkeypatch.delenv(SWITCH)
        monkeypatch.delenv(var)


@pytest.mark.parametrize("n", [2, 3])
def test_mismatched_calls_raise_instead_of_hanging(n):
    """Sync server, workers in different calls (get of one table, barrier, get of another):
    Multiverso hung; here every worker raises, naming what each one waits in."""
    r = run(["deadlock", n])
    failed(r)
    assert "deadlock in" in r.output and "worker 0 in get() number 2 of table 0" in r.output
    assert "worker 1 in barrier()" in r.output


def test_default_number_of_workers(monkeypatch):
    """One per visible GPU when there are GPUs, else one per core."""
    import os

    from synkhronos.multiverso import api

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert api._default_workers() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert api._default_workers() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert api._default_workers() == len(os.sched_getaffinity(0))
