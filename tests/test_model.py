"""Model-based random test: synkhronos against a plain numpy model of every
process's copy of every shared variable (issue 29).

Each run forks n processes (1, 2, 3 and 5; the master not always rank 0; make test runs
shorter sequences on 2 and 3, make test-slow the full ones),
builds a fixed world of shared variables, functions and synk.data
(tests/model_lib.py), and applies random steps to synkhronos and to the model:
function calls (every output op, ``num_slices``, ``batch``, ``batch_s``,
``output_subset``, broadcast inputs 0-d included, a swap of two variables,
the momentum pattern, givens, updates PyTensor runs in place, synk.data inputs
resized or rewritten in place, a graph that raises in some processes only,
calls refused at the public edge, ``as_pytensor``), every collective with
every op, ``set_value`` of shapes that differ per rank, plain ``set_value`` on
the master's copy, variables and functions made after ``distribute()``,
values on both sides of the sizes the library switches at (256 B, 8 KiB,
64 KiB, 256 KiB), collectives over 17 to 300 variables, idle gaps of 0, 1 and
50 ms, and now and then ``close()`` and a new fork. Most calls and
collectives repeat a few habitual forms (the same variable lists, the same
input shapes), as a training loop does: the library keeps plans for those.
After every step every rank's copy of every variable (one ``get_value``
command per rank), the master's own copies and every returned value are
compared with the model bit for bit; returned arrays are then scribbled on
(they are the caller's: nothing may alias them) or kept and checked to stay
unchanged.

On a failure the test replays the run in fresh forks, deleting steps (delta
debugging), and fails with the seed and the shortest failing sequence found,
as the synkhronos calls each step made.

Options (tests/conftest.py):

* ``--model-steps N``: steps per process count instead of ``STEPS``;
* ``--soak SECONDS``: ``test_model_soak`` runs random seeds for that many
  seconds per process count (skipped when 0, the default), e.g.
  ``pytest tests/test_model.py -k soak --soak 600``;
* environment ``SYNK_MODEL_SEED=<seed>`` and ``SYNK_MODEL_MASTER=<rank>``
  replace the fixed seed and master (to replay a run a failure printed),
  ``SYNK_MODEL_MINIMISE=<seconds>`` the time the minimiser may take (180 by
  default; 0: report the unminimised run).

The tests at the end reproduce, one each, the bugs the model found.
"""

from __future__ import annotations

import faulthandler
import os
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from conftest import MODE
from numpy.testing import assert_array_equal

import synkhronos as synk
from model_lib import minimise, random_steps, report, run_steps

#: Steps per process count in the full run (marked slow: make test-slow).
STEPS = {1: 1500, 2: 1000, 3: 800, 5: 500}
#: make test's run: 2 processes (the master rank 1) and 3 (uneven splits), a sixth of the steps
#: (a sequence of its own: the gaps and the steps' seeds follow the count).
QUICK_STEPS = {2: 160, 3: 120}
#: The master's rank per process count (fork(master_rank=...)): not always 0.
MASTER = {1: 0, 2: 1, 3: 0, 5: 2}
SEED = 2029


def _minimise_budget() -> float:
    return float(os.environ.get("SYNK_MODEL_MINIMISE", "180"))


def _run_seed(fork, n, master, seed, count, deadline=None) -> None:
    steps = random_steps(seed, count)
    failure = run_steps(n, steps, fork, master, deadline=deadline)
    if failure is None:
        return
    again = (f"\n  the whole run again: SYNK_MODEL_SEED={seed} SYNK_MODEL_MASTER={master} "
             f"pytest tests/test_model.py -k 'random and n{n}' --model-steps {count}")
    budget = _minimise_budget()
    if budget <= 0:
        pytest.fail(report(seed, n, master, count, steps[: failure.index + 1], failure, note=", not minimised")
                    + again, pytrace=False)
    small, small_failure, replays = minimise(n, steps, failure, fork, master, budget_s=budget)
    note = f"; minimised in {replays} replays"
    pytest.fail(report(seed, n, master, count, small, small_failure, note) + again, pytrace=False)


@pytest.mark.timeout(1200, method="thread")
@pytest.mark.parametrize("n, steps", [pytest.param(n, STEPS[n], marks=pytest.mark.slow, id=f"n{n}") for n in STEPS]
                         + [pytest.param(n, c, id=f"n{n}-quick") for n, c in QUICK_STEPS.items()])
def test_model_random(fork, n, steps, request):
    count = request.config.getoption("--model-steps") or steps
    seed = int(os.environ.get("SYNK_MODEL_SEED", SEED * 10 + n))
    master = int(os.environ.get("SYNK_MODEL_MASTER", MASTER[n]))
    _run_seed(fork, n, master, seed, count)


@pytest.mark.timeout(0)
@pytest.mark.parametrize("n", [1, 2, 3, 5], ids=lambda n: f"n{n}")
def test_model_soak(fork, n, request):
    seconds = request.config.getoption("--soak")
    if not seconds:
        pytest.skip("the soak runs with --soak SECONDS")
    count = request.config.getoption("--model-steps") or 2000
    # a hang is a failure too: dump every thread's stack and end the run
    faulthandler.dump_traceback_later(seconds + _minimise_budget() + 600, exit=True)
    try:
        end = time.monotonic() + seconds
        rng = np.random.default_rng()
        while time.monotonic() < end:
            seed = int(rng.integers(2**31 - 1))
            _run_seed(fork, n, int(rng.integers(n)), seed, count, deadline=end)
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------------------
# the bugs the model found, one reproducer each


def test_regression_gather_after_set_value_reshape(fork):
    """gather(nd_up=0) after set_value gave one rank a longer value: every run
    returns every row (the second dropped one)."""
    fork(2)
    v = pytensor.shared(np.zeros(2), name="v")
    synk.function([], v.sum(), mode=MODE)
    synk.distribute()
    synk.set_value(1, v, np.array([10.0, 20.0, 30.0]))
    for _ in range(3):
        got = synk.gather(v, nd_up=0)
        assert got.dtype == np.float64 and got.shape == (5,)
        assert_array_equal(got, [0.0, 0.0, 10.0, 20.0, 30.0])


def test_regression_all_reduce_after_swap(fork):
    """all_reduce([B, C]) after a call that swapped B and C (updates [(B, C), (C, B)])."""
    fork(2)
    B = pytensor.shared(np.ones(4, "float32"), name="B")
    C = pytensor.shared(np.full(4, 2, "float32"), name="C")
    swap = synk.function([], [(B.sum(), "sum")], updates=[(B, C), (C, B)], mode=MODE)
    synk.distribute()
    synk.all_reduce(C, op="sum")  # C = 4 everywhere
    swap()                         # B = 4, C = 1 everywhere
    synk.all_reduce([B, C], op="prod")
    for r in range(2):
        b, c = synk.get_value(r, [B, C])
        assert b.dtype == np.float32 and c.dtype == np.float32
        assert_array_equal(b, np.full(4, 16, "float32"), err_msg=f"B on rank {r}")
        assert_array_equal(c, np.ones(4, "float32"), err_msg=f"C on rank {r}")


def test_regression_all_reduce_after_momentum(fork):
    """all_reduce([prev, w]) after updates [(prev, w), (w, w + 1)]."""
    fork(2)
    w = pytensor.shared(np.zeros(3), name="w")
    prev = pytensor.shared(np.zeros(3), name="prev")
    step = synk.function([], [], updates=[(prev, w), (w, w + 1)], mode=MODE)
    synk.distribute()
    synk.all_reduce([prev, w], op="sum")
    step()                                # prev = 0, w = 1 in each process
    synk.all_reduce([prev, w], op="sum")  # prev = 0, w = 2
    for r in range(2):
        p, ww = synk.get_value(r, [prev, w])
        assert_array_equal(p, np.zeros(3), err_msg=f"prev on rank {r}")
        assert_array_equal(ww, np.full(3, 2.0), err_msg=f"w on rank {r}")


def test_regression_zero_d_bcast_input_second_call(fork):
    """A 0-d numpy broadcast input: the second call (planned) raised IndexError."""
    fork(2)
    x = pt.vector("x")
    lr = pt.scalar("lr", dtype="float64")
    f = synk.function([x, lr], ((x * lr).sum(), "sum"), bcast_inputs=[lr], mode=MODE)
    X = np.arange(10.0)
    got = f(X, np.array(0.5))
    assert got.dtype == np.float64 and got.shape == ()
    assert got == 22.5
    got = f(X, np.array(2.0))
    assert got.dtype == np.float64 and got.shape == ()
    assert got == 90.0
    assert f(X, np.array(0.5)) == 22.5


def test_regression_all_gather_returns_new_memory(fork):
    """all_gather's returned array is the caller's: writing it changes no variable."""
    fork(2)
    P = pytensor.shared(np.zeros(3), name="P")
    synk.function([], P.sum(), mode=MODE)
    synk.distribute()
    r = synk.all_gather(P)
    assert_array_equal(r, np.zeros(6))
    r[0] = 123.0
    assert_array_equal(P.get_value(), np.zeros(6))
    for rank in range(2):
        assert_array_equal(synk.get_value(rank, P), np.zeros(6), err_msg=f"P on rank {rank}")


@pytest.mark.parametrize("master", [0, 1])
def test_regression_planned_call_weight_after_sliceable_resize(fork, master):
    """A planned call (no inputs, batch_s=None) of a function with sliceable shared
    variables weighed the master's share with the row count of its first call after
    the variable changed length: 'avg' outputs came out wrong."""
    fork(2, master_rank=master)
    S = pytensor.shared(np.zeros((6, 2)), name="S")
    f = synk.function([], (S.sum(axis=0), "avg"), sliceable_shareds=[S], mode=MODE)
    assert_array_equal(f(), [0.0, 0.0])
    synk.scatter(S, np.array([[1.0, 1.0], [4.0, 4.0], [4.0, 4.0]]))  # rank 0: 2 rows, rank 1: 1 row
    want = np.array([5.0, 5.0]) * (2 / 3) + np.array([4.0, 4.0]) * (1 / 3)  # weighed by rows
    for _ in range(2):
        got = f()
        assert got.dtype == np.float64 and got.shape == (2,)
        assert_array_equal(got, want)


@pytest.mark.parametrize("n", [1, 2])
def test_regression_reduce_returns_arrays_for_0d_integer_avg(fork, n):
    """reduce(in_place=False) returns ndarrays: the 0-d avg of an integer came back as a numpy scalar."""
    fork(n)
    c = pytensor.shared(np.int64(7), name="c")
    f = pytensor.shared(np.float64(7), name="f")
    synk.function([], [c + 0, f + 0], mode=MODE)
    synk.distribute()
    for var in (c, f):
        for op in ("avg", "sum", "max", "c_avg"):
            for _ in range(2):  # the inline path, then the kept plan
                got = synk.reduce(var, op=op, in_place=False)
                assert type(got) is np.ndarray and got.dtype == var.dtype and got.shape == ()
                assert got == (7 if op.endswith(("avg", "max")) else 7 * n)
