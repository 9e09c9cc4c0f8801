"""Errors at the public edge name the offending value; a worker's error comes home whole."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from numpy.testing import assert_array_equal
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.raise_op import Assert

import synkhronos as synk
from synkhronos._procs.cores import available_cores
from conftest import MODE, worker_pids


@pytest.fixture
def fn2(fork):
    """A 2-process fork and a function of an int matrix and a float matrix."""
    fork(2)
    xi = pt.lmatrix("xi")
    x = pt.dmatrix("x")
    f = synk.function([xi, x], [(xi.sum(), "sum"), (x.sum(), "sum")], mode=MODE, name="fn")
    a = np.ones((4, 2), dtype=np.int64)
    b = np.ones((4, 2))
    assert f(a, b) == [8, 8.0]
    return f, a, b


# ---------------------------------------------------------------------------
# before fork, fork twice, bad fork arguments


def test_calls_before_fork():
    x = pt.dmatrix("x")
    with pytest.raises(RuntimeError, match=r"not running: call synk.fork\(\) first"):
        synk.function([x], x.sum(), mode=MODE)
    with pytest.raises(RuntimeError, match=r"call synk.fork\(\) first"):
        synk.data(np.ones(3))
    with pytest.raises(RuntimeError, match=r"call synk.fork\(\) first"):
        synk.distribute()
    synk.close()  # close before fork does nothing


def test_fork_twice(fork):
    fork(2)
    with pytest.raises(RuntimeError, match=r"already called; call synk.close\(\) before forking again"):
        synk.fork(2)
    # the first fork is untouched
    x = pt.dmatrix("x")
    f = synk.function([x], (x, "gather"), mode=MODE)
    assert_array_equal(f(np.eye(3)), np.eye(3))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(n_parallel=0), ValueError, "n_parallel must be at least 1, got 0"),
    (dict(n_parallel=-2), ValueError, "got -2"),
    (dict(n_parallel="2"), TypeError, "n_parallel must be a positive int or None, got '2'"),
    (dict(n_parallel=2.0), TypeError, "got 2.0"),
    (dict(n_parallel=True), TypeError, "got True"),
    (dict(n_parallel=2, device="tpu"), ValueError, "device must be one of .*got 'tpu'"),
    (dict(n_parallel=2, master_rank=2), ValueError, r"master_rank must be in \[0, 2\), got 2"),
    (dict(n_parallel=2, master_rank=-1), ValueError, "got -1"),
    (dict(n_parallel=2, master_rank="0"), TypeError, "master_rank must be an int, got '0'"),
])
def test_bad_fork_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        synk.fork(**kwargs)
    # nothing was started: fork works right away
    assert synk.fork(1, device="cpu") == 1
    synk.close()


def test_gpu_without_gpu_stack():
    try:
        import cupy  # noqa: F401
        pytest.skip("the GPU stack is installed")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match=r"device='gpu' needs .*pip install synkhronos\[gpu\]"):
        synk.fork(2, device="gpu")


def test_more_processes_than_cores_warns():
    n = available_cores() + 1
    with pytest.warns(UserWarning, match=f"n_parallel={n} is more than the {n - 1} cores"):
        synk.fork(n, device="cpu")
    synk.close()


def test_fork_again_after_close(fork):
    x = pt.dmatrix("x")
    fork(2)
    f = synk.function([x], (x, "gather"), mode=MODE)
    assert_array_equal(f(np.eye(4)), np.eye(4))
    old_workers = set(worker_pids().values())
    synk.close()
    synk.close()  # twice is fine
    with pytest.raises(RuntimeError, match="call synk.fork"):
        f(np.eye(4))  # a function of a closed fork
    fork(3)
    assert not old_workers & set(worker_pids().values())
    g = synk.function([x], [(x, "gather"), (x.sum(), "sum")], mode=MODE)
    got = g(np.eye(5))
    assert_array_equal(got[0], np.eye(5))
    assert got[1] == 5.0


# ---------------------------------------------------------------------------
# bad calls


def test_wrong_input_counts(fn2):
    f, a, b = fn2
    with pytest.raises(TypeError, match=r"function 'fn' is missing inputs \['x'\]"):
        f(a)
    with pytest.raises(TypeError, match="function 'fn' takes 2 inputs, got 3 positional"):
        f(a, b, b)
    with pytest.raises(TypeError, match="input 'xi' of function 'fn' given twice"):
        f(a, b, xi=a)
    with pytest.raises(TypeError, match="build_inputs got 1"):
        f.build_inputs(a)


def test_wrong_dtype(fn2):
    f, a, b = fn2
    with pytest.raises(TypeError, match=r"input 'xi' of function 'fn'.*int64.*float64"):
        f(b, b)
    with pytest.raises(TypeError, match=r"input 'xi' of function 'fn' expects dtype int64, "
                                        r"got synk.data #\d+ of dtype float64, which would lose "
                                        r"precision: create it with synk.data\(value, dtype='int64'\)"):
        f(synk.data(b), b)
    # a safe upcast is accepted
    assert f(a.astype(np.int32), b) == [8, 8.0]
    # object arrays, as PyTensor's own functions get them, are refused by name
    with pytest.raises(TypeError, match=r"input 'x' of function 'fn' expects a numeric array of dtype "
                                        r"float64, got an array of dtype object: array\(\[\[1, None\]"):
        f(a, np.array([[1, None]] * 4, dtype=object))
    with pytest.raises(TypeError, match="got an array of dtype object"):
        f(a, [[1.0, None]] * 4)  # a list that becomes an object array
    with pytest.raises(TypeError, match=r"expects a numeric array of dtype float64, got an array of "
                                        r"dtype <U32: \[\[1.0, 'x'\]"):
        f(a, [[1.0, "x"]] * 4)


def test_wrong_ndim(fn2):
    f, a, b = fn2
    # a TypeError, as from PyTensor's own functions
    with pytest.raises(TypeError, match=r"input 'x' of function 'fn' expects ndim=2, got ndim=1 "
                                        r"\(shape \(4,\)\)"):
        f(a, np.ones(4))
    with pytest.raises(TypeError, match="expects ndim=2, got synk.data with ndim=1"):
        f(synk.data(np.ones(4, dtype=np.int64)), b)
    with pytest.raises(TypeError, match="expects ndim=2, got ndim=3"):
        f(a, np.ones((4, 2, 1)))


def test_inputs_of_different_lengths(fn2):
    f, a, b = fn2
    with pytest.raises(ValueError, match=r"differ in length: \{'xi': 4, 'x': 3\}"):
        f(a, b[:3])
    # with a batch, the shortest length bounds it
    assert f(a, b[:3], batch=3) == [6, 6.0]
    with pytest.raises(ValueError, match="minibatch inputs .* fewer rows than the 3 asked for"):
        f(a, synk.data(b[:2], minibatch=True), batch=3)


def test_unknown_input_name(fn2):
    f, a, b = fn2
    with pytest.raises(TypeError, match=r"function 'fn' has no input named 'z'; its inputs are "
                                        r"\['xi', 'x'\]"):
        f(a, b, z=b)


@pytest.mark.parametrize("batch,exc,match", [
    (5, IndexError, "batch=5 asks for the first 5 rows, but the inputs have 4 rows"),
    (-1, IndexError, "batch=-1"),
    ([0, 4], IndexError, "batch index 4 is out of range for inputs of 4 rows"),
    (np.array([-5, 0]), IndexError, "batch index -5 is out of range"),
    (slice(0, 9), IndexError, r"batch slice slice\(0, 9, None\) is out of range for inputs of 4 rows"),
    (slice(None, None, -1), ValueError, "batch slice step must be positive, got -1"),
    (slice(0, 2.5), TypeError, "batch slice stop must be an int or None, got 2.5"),
    (1.5, TypeError, "got float"),
    (True, TypeError, "got True"),
    ([[0, 1]], ValueError, r"batch index array must be 1-d, got shape \(1, 2\)"),
    ([0.0, 1.0], TypeError, "batch index array must hold integers, got dtype float64"),
])
def test_bad_batch(fn2, batch, exc, match):
    f, a, b = fn2
    with pytest.raises(exc, match=match):
        f(a, b, batch=batch)
    with pytest.raises(exc, match=match):
        f(synk.data(a), synk.data(b), batch=batch)
    assert f(a, b) == [8, 8.0]


def test_batch_without_scattered_inputs(fork):
    fork(2)
    w = pt.dvector("w")
    f = synk.function([w], w.sum(), bcast_inputs=[w], mode=MODE, name="bc")
    with pytest.raises(ValueError, match="batch=2 given, but function 'bc' has no scattered inputs"):
        f(np.ones(3), batch=2)


@pytest.mark.parametrize("num_slices", [0, -1, 1.5, 2.0, "2", True, None])
def test_bad_num_slices(fn2, num_slices):
    f, a, b = fn2
    with pytest.raises(ValueError, match=f"num_slices must be a positive int, got {num_slices!r}"):
        f(a, b, num_slices=num_slices)


def test_bad_output_subset(fn2):
    f, a, b = fn2
    with pytest.raises(IndexError, match=r"output_subset \[0, 2\] names outputs \[2\]; "
                                         r"function 'fn' has 2 outputs"):
        f(a, b, output_subset=[0, 2])
    with pytest.raises(IndexError, match=r"names outputs \[-1\]"):
        f(a, b, output_subset=[-1])
    with pytest.raises(TypeError, match="output_subset must be a list of output indices, got 1"):
        f(a, b, output_subset=1)
    with pytest.raises(TypeError, match="output_subset must be a list of output indices, got '0'"):
        f(a, b, output_subset="0")
    for bad, shown in ((1.7, "1.7"), (True, "True"), (np.True_, "np.True_"), ("0", "'0'"), (None, "None")):
        with pytest.raises(TypeError, match=rf"output_subset must hold int output indices, got {shown} in"):
            f(a, b, output_subset=[0, bad])
    assert f(a, b, output_subset=np.array([1, 0])) == [8.0, 8]
    assert f(a, b, output_subset=[1]) == [8.0]


def test_bad_function_arguments(fork):
    fork(2)
    x = pt.dmatrix("x")
    c = pt.dscalar("c")
    with pytest.raises(ValueError, match=r"unknown output op 'median'; expected one of \['avg'"):
        synk.function([x], (x.sum(), "median"), mode=MODE)
    with pytest.raises(ValueError, match="unknown output op 'c_median'"):
        synk.function([x], [(x.sum(), "c_median")], mode=MODE)
    with pytest.raises(TypeError, match="output op must be one of .* got 3"):
        synk.function([x], [(x.sum(), 3)], mode=MODE)
    with pytest.raises(ValueError, match="unknown output op 'mean'"):
        synk.function([x], x.sum(), reduce_ops="mean", mode=MODE)
    with pytest.raises(ValueError, match="reduce_ops has 1 entries for 2 outputs"):
        synk.function([x], [x.sum(), x.max()], reduce_ops=["sum"], mode=MODE)
    s = pytensor.shared(np.float64(0.0), name="s")
    with pytest.raises(ValueError, match="unknown update op 'gather'"):
        synk.function([x], updates=[(s, s + x.sum(), "gather")], mode=MODE)
    with pytest.raises(TypeError, match="update target must be a shared variable"):
        synk.function([x], updates=[(x, x + 1)], mode=MODE)
    with pytest.raises(ValueError, match="input 'c' is 0-d and cannot be scattered"):
        synk.function([x, c], x.sum() * c, mode=MODE)
    with pytest.raises(IndexError, match="bcast_inputs position 2 is out of range for 2 inputs"):
        synk.function([x, c], x.sum() * c, bcast_inputs=[2], mode=MODE)
    with pytest.raises(TypeError, match="inputs must be a list of PyTensor variables, got"):
        synk.function(x, x.sum(), mode=MODE)
    with pytest.raises(TypeError, match="outputs must be PyTensor variables, got 'y'"):
        synk.function([x], ["y"], mode=MODE)
    with pytest.raises(TypeError, match="output_subset is a call keyword"):
        synk.function([x], x.sum(), output_subset=[0], mode=MODE)
    # the runtime is still fine
    f = synk.function([x], (x.sum(), "sum"), mode=MODE)
    assert f(np.ones((3, 2))) == 6.0


# ---------------------------------------------------------------------------
# an exception inside a worker


def _failing_function(op):
    """A function whose Assert fails on rows that sum to 100 or more."""
    x = pt.dmatrix("x")
    checked = Assert("rows sum too large")(x, pt.lt(x.sum(), 100))
    outputs = [(checked.sum(axis=0), op), (x.shape[0], "sum")] if op != "none-only" \
        else [(checked.sum(axis=0), None)]
    return synk.function([x], outputs, mode=MODE, name="checked")


def _rows_failing_on_last_rank(n):
    a = np.ones((3 * n, 2))
    a[-3:] = 50.0  # split evenly: exactly the last rank's rows
    return a


@pytest.mark.parametrize("op", ["sum", "avg", "gather", "none-only"])
@pytest.mark.parametrize("n", [2, 3])
def test_worker_exception_comes_home(fork, n, op):
    fork(n)
    f = _failing_function(op)
    good = np.ones((3 * n, 2))
    bad = _rows_failing_on_last_rank(n)
    synk.distribute()
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="rows sum too large") as info:
        f(bad)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert isinstance(err.__cause__, synk.RemoteTraceback)
    text = str(err.__cause__)
    assert f"Traceback from worker rank {n - 1}" in text
    assert "AssertionError: rows sum too large" in text
    assert getattr(err, "synk_rank", None) == n - 1
    # the runtime stays usable, again and again
    for _ in range(2):
        got = f(good)
        first = got[0]
        if op == "gather":
            assert_array_equal(first, np.tile([3.0, 3.0], n))  # each process sums its 3 rows
        elif op == "sum":
            assert_array_equal(first, good.sum(axis=0))
        elif op == "avg":
            assert_array_equal(first, [3.0, 3.0])  # each process sums 3 rows of ones
        else:
            assert_array_equal(first, [3.0, 3.0])  # the master's own 3 rows
        with pytest.raises(AssertionError):
            f(bad)


def test_master_exception_is_its_own(fork):
    """The master's own rows fail: the master's exception, without a remote traceback."""
    fork(2)
    f = _failing_function("sum")
    bad = np.ones((6, 2))
    bad[:3] = 50.0
    with pytest.raises(AssertionError, match="rows sum too large") as info:
        f(bad)
    assert not isinstance(info.value.__cause__, synk.RemoteTraceback)
    assert_array_equal(f(np.ones((6, 2)))[0], [6.0, 6.0])


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_of_mismatched_shapes(fork, n):
    """Uneven rows and a per-row output reduced with sum: an error naming both shapes."""
    fork(n)
    x = pt.dmatrix("x")
    f = synk.function([x], [(x * 1.0, "sum"), (x.sum(), "max"), (x, "gather")], mode=MODE)
    with pytest.raises(ValueError, match=r"cannot sum-reduce: rank 0 holds .*\(\d, 2\).* but rank 1 "
                                         r"holds .*\(\d, 2\)"):
        f(np.ones((3 * n + 1, 2)))
    total, mx, gathered = f(np.ones((3 * n, 2)))
    assert_array_equal(total, np.full((3, 2), float(n)))
    assert mx == 6.0
    assert_array_equal(gathered, np.ones((3 * n, 2)))


class _PickyError(Exception):
    """An exception that pickles but does not unpickle (two required arguments)."""

    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")


class _FailOnRank(Op):
    """Identity that raises _PickyError in the process whose rows start with 7."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        (x,) = inputs
        if x.shape[0] and x[0, 0] == 7.0:
            raise _PickyError("picky", os.getpid())
        outputs[0][0] = x.copy()


def test_unpicklable_worker_exception_becomes_worker_error(fork):
    fork(2)
    x = pt.dmatrix("x")
    f = synk.function([x], (_FailOnRank()(x).sum(), "sum"), mode=MODE)
    a = np.ones((4, 2))
    a[2:] = 7.0
    with pytest.raises(synk.WorkerError, match=r"worker rank 1 raised: _PickyError: picky at "
                                               f"{worker_pids()[1]}") as info:
        f(a)
    assert info.value.rank == 1
    assert "_PickyError" in info.value.remote_traceback
    assert f(np.ones((4, 2))) == 8.0


def test_dead_worker_is_noticed(fork):
    fork(3)
    x = pt.dmatrix("x")
    f = synk.function([x], (x, "gather"), mode=MODE)
    assert_array_equal(f(np.eye(3)), np.eye(3))
    pid = worker_pids()[2]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="worker rank 2 died .*SIGKILL") as info:
        f(np.eye(3))
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 2
    with pytest.raises(synk.SynkError, match="unusable after an earlier failure"):
        f(np.eye(3))
    synk.close()  # ends the other worker and unlinks everything (checked after the test)


# ---------------------------------------------------------------------------
# many processes; no assert on a user's path


@pytest.mark.slow
@pytest.mark.timeout(300, method="thread")
def test_fork_300_processes():
    """The control block grows with the ranks (it held 248 at most, behind a bare assert)."""
    import pickle
    import warnings

    from synkhronos import _runtime as runtime
    from synkhronos._protocol.control import Command

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # more processes than cores
        assert synk.fork(300, device="cpu") == 300
    s = runtime.running_session()
    assert len(worker_pids()) == 299
    for _ in range(2):  # round trips through all 300 ranks (compiling nothing: kept short)
        s.run(Command.DISTRIBUTE, pickle.dumps(([], [])))
    synk.close()


def test_no_assert_statements_in_the_package():
    """``python -O`` strips asserts: no check a user relies on may be one."""
    import ast
    from pathlib import Path

    root = Path(synk.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert found == [], f"assert statements in synkhronos: {found}"


@pytest.mark.parametrize("n", [2, 5])  # (5 on 2 cores: the master's share fails before some worker's began)
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "communicator"])
def test_a_failed_call_applies_exactly_the_updates_of_the_shares_that_ran(fork, n, inline):
    """The rule of a failed call: a process applies its updates exactly when its
    own share ran without error, whoever failed (the master included), the same
    every time, on a planned call and a fresh one, whether the outputs ride in
    the reply areas or go through the communicator (a gather of rows). Workers
    that sleep between commands (``idle_spin=0``) wake after a failure of the
    master's share: they used to be stopped before they began, or not."""
    fork(n, idle_spin=0)
    x = pt.dmatrix("x")
    count = pytensor.shared(np.int64(0), name="count")
    checked = Assert("too big")(x, pt.all(pt.lt(x, 1000)))
    out = (checked.sum(), "sum") if inline else (checked * 2, "gather")
    f = synk.function([x], out, updates=[(count, count + 1)], mode=MODE)
    synk.distribute()
    rows = [len(range(*synk._batching.split(3 * n, n, r))) for r in range(n)]
    held = np.zeros(n, np.int64)
    for i in range(36):
        bad_rank = i % (n + 1)  # n: nobody fails
        x_value = np.ones((3 * n, 2))
        if bad_rank < n:
            x_value[sum(rows[:bad_rank])] = 5000.0  # a row of that rank's share only
        if i % 4 == 3:
            x_value = x_value.copy(order="F")  # not planned: the full path
        if bad_rank < n:
            with pytest.raises(AssertionError, match="too big") as info:
                f(x_value)
            applied = [r for r in range(n) if r != bad_rank]
            assert (f"this call's updates were applied by ranks {applied}, whose shares ran without "
                    f"error, and not by ranks [{bad_rank}]") in "\n".join(info.value.__notes__)
        else:
            f(x_value)
        held += np.arange(n) != bad_rank
        got = np.array([int(synk.get_value(r, count)) for r in range(n)])
        assert_array_equal(got, held, err_msg=f"call {i}, rank {bad_rank} failed")
