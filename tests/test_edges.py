"""Edge cases: empty batches, prefixes kept, 0-d data, broadcast inputs appended."""

import os
import signal
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos import _runtime as runtime
from conftest import MODE, worker_pids


def test_empty_batch_is_computed_like_pytensor(forked):
    x = pt.dvector("x")
    f = synk.function([x], [(x.sum(), "sum"), (x.shape[0], "sum"), (x, "gather")], mode=MODE)
    total, count, rows = f(np.arange(5.0), batch=0)
    assert total == 0.0 and count == 0 and rows.shape == (0,)
    total, count, rows = f(np.zeros(0))
    assert total == 0.0 and count == 0 and rows.shape == (0,)


@pytest.mark.parametrize("batch_s", [[], slice(0, 0), "each empty"])
def test_batch_s_of_no_rows_is_computed_like_pytensor(forked, batch_s):
    """A batch_s that selects no row in any process: the master computes on its empty
    selection, as for an empty batch of scattered inputs (every output came back None)."""
    n = forked
    xs = pytensor.shared(np.zeros((1, 3)), name="xs")
    c = pytensor.shared(np.int64(0), name="c")
    f = synk.function([], [(xs.sum(axis=0), "sum"), (xs.shape[0], "sum"), (xs, "gather"), (xs * 2, None)],
                      sliceable_shareds=[xs], updates=[(c, c + 1)], mode=MODE)
    synk.distribute()
    synk.scatter(xs, np.arange(6.0 * n).reshape(2 * n, 3))
    total, count, rows, own = f(batch_s=[[]] * n if batch_s == "each empty" else batch_s)
    assert total.shape == (3,) and not total.any() and count == 0
    assert rows.shape == (0, 3) and own.shape == (0, 3)
    assert [int(synk.get_value(r, c)) for r in range(n)] == [1] + [0] * (n - 1)  # the master alone, as PyTensor


def test_op_none_output_of_a_master_whose_batch_s_selects_none(fork):
    """The master's own output (op None) on its own selection, none: not None."""
    fork(2)
    xs = pytensor.shared(np.zeros((1, 3)), name="xs")
    f = synk.function([], [(xs.sum(axis=0), "sum"), (xs * 2, None)], sliceable_shareds=[xs], mode=MODE)
    synk.distribute()
    synk.scatter(xs, np.arange(12.0).reshape(4, 3))
    total, own = f(batch_s=[[], [0]])
    np.testing.assert_array_equal(total, [6.0, 7.0, 8.0])
    assert own is not None and own.shape == (0, 3)


def test_output_modes_keep_the_cpu_prefix(fork):
    fork(2)
    x = pt.dvector("x")
    f = synk.function([x], [(x.sum(), "c_sum"), (x.max(), "max"), (x.min(), None)], mode=MODE)
    assert f.output_modes == ["c_sum", "max", None]
    total, top, own = f(np.arange(6.0))
    assert (total, top, own) == (15.0, 5.0, 0.0)


def test_zero_d_data_keeps_memory_after_free(fork):
    fork(2)
    d = synk.data(dtype="float64", ndim=0)
    d.free_memory()
    assert d.shape == () and d.size == 1
    d.set_value(3.5)
    assert float(d.data) == 3.5


def test_broadcast_input_missing_from_inputs_is_appended(fork):
    fork(2)
    x, y = pt.dmatrix("x"), pt.dmatrix("y")
    f = synk.function([x], x.dot(y).mean(axis=0), broadcast_inputs=[y], mode=MODE)
    assert [v.name for v in f.inputs] == ["x", "y"]
    a, b = np.random.rand(7, 3), np.random.rand(3, 2)
    np.testing.assert_allclose(f(a, b), a.dot(b).mean(axis=0))
    with pytest.raises(TypeError, match="not both"):
        synk.function([x], x.sum(), bcast_inputs=[y], broadcast_inputs=[y], mode=MODE)


def test_sigterm_ends_an_idle_worker_promptly(fork):
    fork(2)
    x = pt.dvector("x")
    f = synk.function([x], x.sum(), mode=MODE)
    f(np.ones(4))
    time.sleep(0.1)  # the worker now sleeps in its semaphore wait
    pid = worker_pids()[1]
    os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + 5
    done = 0
    while time.monotonic() < end and not done:
        done, _ = os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)
    # reaped here, the fork's own watch no longer sees it; the fork is then closed
    assert done == pid
    # a terminated worker, unlike a dead master, leaves the fork's names alone
    from conftest import shm_names

    assert any(name.endswith("ctl") for name in shm_names())
    runtime.running_session().watch.exited[1] = 0  # reaped here, so tell the fork's watch


@pytest.mark.parametrize("n", [1, 2])
def test_in_place_all_reduce_survives_pytensor_reusing_update_storage(fork, n):
    """PyTensor (Numba mode) may give the old storage of an updated shared
    variable to another one; all_reduce must then not write into it."""
    from synkhronos.extensions import make_train_function

    fork(n)
    rng = np.random.default_rng(0)
    W = pytensor.shared(rng.normal(size=(16, 8)) * 0.1, name="W")
    x, y = pt.dmatrix("x"), pt.dvector("y")
    loss = ((x.dot(W).sum(axis=1) - y) ** 2).mean()
    step = make_train_function(loss, [W], [x, y], "adam", learning_rate=0.01)  # default (Numba) mode
    X, Y = rng.normal(size=(12, 16)), rng.normal(size=12)
    W0 = W.get_value().copy()
    losses = [step(X, Y) for _ in range(5)]
    W1 = W.get_value().copy()
    W.set_value(W0)
    for s in step.state:
        s.set_value(np.zeros_like(s.get_value()))
    expected = [step.as_pytensor(X, Y) for _ in range(5)]
    np.testing.assert_allclose(losses, expected, rtol=1e-9)
    np.testing.assert_allclose(W1, W.get_value(), rtol=1e-9)


def test_pinning_gives_each_process_its_cores_and_close_restores(fork):
    before = os.sched_getaffinity(0)
    n = min(2, len(before))
    fork(n, pin_cores=True)
    mine = os.sched_getaffinity(0)
    theirs = [os.sched_getaffinity(pid) for pid in worker_pids().values()]
    groups = [mine] + theirs
    assert all(len(g) == len(before) // n for g in groups)
    assert len(set().union(*groups)) == sum(len(g) for g in groups), "cores shared between processes"
    synk.close()
    assert os.sched_getaffinity(0) == before


def _blas_threads() -> int:
    from threadpoolctl import threadpool_info

    return max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")


def test_master_free_lifts_the_binding_and_thread_cap_for_a_block(fork):
    """Inside synk.master_free() the master has the cores and BLAS threads it had before
    fork(); calls there give the same results; afterwards it is bound and capped again;
    close() inside the block restores everything once; misuse is a clear error."""
    before, threads_before = os.sched_getaffinity(0), _blas_threads()
    with pytest.raises(RuntimeError, match="not running"):
        with synk.master_free():
            pass
    n = min(2, len(before))
    fork(n, pin_cores=True)
    bound, capped = os.sched_getaffinity(0), _blas_threads()
    assert capped == max(1, len(before) // n)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    rows = np.arange(12.0).reshape(6, 2)
    for _ in range(2):
        with synk.master_free():
            assert os.sched_getaffinity(0) == before and _blas_threads() == threads_before
            np.testing.assert_allclose(f(rows), rows.sum(0))  # a call in the block still works
            with pytest.raises(RuntimeError, match="do not nest"):
                with synk.master_free():
                    pass
        assert os.sched_getaffinity(0) == bound and _blas_threads() == capped
        np.testing.assert_allclose(f(rows), rows.sum(0))
    with synk.master_free():
        synk.close()
    assert os.sched_getaffinity(0) == before and _blas_threads() == threads_before


def test_no_pinning_when_asked_or_oversubscribed(fork):
    before = os.sched_getaffinity(0)
    fork(2, pin_cores=False)
    assert os.sched_getaffinity(0) == before
    assert all(os.sched_getaffinity(pid) == before for pid in worker_pids().values())
    synk.close()
    fork(len(before) + 1)  # more processes than cores: nobody is pinned
    assert os.sched_getaffinity(0) == before
    with pytest.raises(TypeError, match="pin_cores must be True, False or None, got 'yes'"):
        synk.close() or synk.fork(2, pin_cores="yes")


def test_calls_from_several_threads_are_serialized(fork):
    import threading

    fork(2)
    x = pt.dvector("x")
    s = pytensor.shared(np.zeros(3), name="s_threads")
    f = synk.function([x], (x.sum(), "sum"), mode=MODE)
    g = synk.function([], s.sum(), mode=MODE)
    errors, results = [], []

    def work(k):
        try:
            for i in range(100):
                results.append((k, i, float(f(np.full(4, float(k))))))
                synk.all_reduce(s, op="sum")
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 300 and all(r == 4.0 * k for k, _, r in results)
    assert float(g()) == 0.0


def test_numba_still_compiles_after_a_fork_closed(fork):
    """Numba refuses a new thread count once its threads run: fork() must
    neither start them in the master nor leave NUMBA_NUM_THREADS changed."""
    fork(2)
    synk.close()
    x = pt.dvector("x")
    c = float(np.random.default_rng().integers(1, 10**9))  # a new graph: compiled now
    f = pytensor.function([x], (pt.exp(x) * c).sum())  # default (Numba) mode
    assert f(np.zeros(3)) == pytest.approx(3 * c)
    fork(2)
    g = synk.function([x], (pt.exp(x) * c).max())  # workers compile too
    assert g(np.zeros(4)) == pytest.approx(c)


@pytest.mark.parametrize("n, master", [(3, 1), (3, 2), (2, 1)])
def test_op_none_output_of_a_master_without_rows(fork, n, master):
    """Fewer rows than processes, and none for the master: an op-None output (the
    master's own result) is computed on its empty share, never None; the others'
    rows decide the reduced outputs; the master applies no update. Calls repeat
    (the kept plan and the inline path)."""
    fork(n, master_rank=master)
    c = pytensor.shared(np.float64(3.0), name="c")
    count = pytensor.shared(np.int64(0), name="count")
    x = pt.dvector("x")
    f = synk.function([x], [(c * 2, None), (x.sum(), "sum"), (x.sum(), None), (x * 1, "gather")],
                      updates=[(count, count + 1)], mode=MODE)
    synk.distribute()
    applied = np.zeros(n, np.int64)
    for rows in (1, 1, 2, 0, 1):
        got = f(np.arange(1.0, rows + 1))
        assert got[0] is not None and float(got[0]) == 6.0, got
        assert float(got[1]) == sum(range(1, rows + 1)), got
        lo, hi = synk._batching.split(rows, n, master)
        assert float(got[2]) == float(np.arange(1.0, rows + 1)[lo:hi].sum()), got
        np.testing.assert_array_equal(got[3], np.arange(1.0, rows + 1))
        for r in range(n):
            lo, hi = synk._batching.split(rows, n, r)
            applied[r] += hi > lo or (rows == 0 and r == master)
    assert [int(synk.get_value(r, count)) for r in range(n)] == applied.tolist()
