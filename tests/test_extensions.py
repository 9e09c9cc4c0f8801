"""Data-parallel update rules: the distributed step equals the single-process step."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.extensions import RULES, make_train_function, plain_updates, updates

from conftest import MODE

RTOL = 1e-6
STEPS = 5
#: Rules without a default learning rate get this one.
NEEDS_LR = {"sgd": 0.1, "momentum": 0.1, "nesterov_momentum": 0.1}


def hyper(rule: str) -> dict:
    return {"learning_rate": NEEDS_LR[rule]} if rule in NEEDS_LR else {}


def mlp(tag: str, seed: int = 7):
    """A small float64 MLP with a mean cross-entropy loss; identical for equal seeds."""
    r = np.random.default_rng(seed)
    w1 = pytensor.shared(r.normal(size=(5, 4)) * 0.5, name=f"w1_{tag}")
    b1 = pytensor.shared(np.zeros(4), name=f"b1_{tag}")
    w2 = pytensor.shared(r.normal(size=(4, 3)) * 0.5, name=f"w2_{tag}")
    x, y = pt.dmatrix("x"), pt.lvector("y")
    prob = pt.special.softmax(pt.tanh(x @ w1 + b1) @ w2, axis=-1)
    loss = -pt.mean(pt.log(prob[pt.arange(y.shape[0]), y]))
    return [w1, b1, w2], x, y, loss


def data(n_rows: int, seed: int = 3):
    r = np.random.default_rng(seed)
    return r.normal(size=(n_rows, 5)), r.integers(0, 3, size=n_rows)


def reference(rule: str):
    """The plain single-process PyTensor step of the same rule, on its own parameters."""
    params, x, y, loss = mlp("ref")
    fn = pytensor.function([x, y], loss, updates=plain_updates(rule, loss, params, **hyper(rule)),
                           mode=MODE)
    return params, fn


def assert_close(got: list, want: list) -> None:
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        scale = np.maximum(np.abs(w), 1e-8)
        assert np.max(np.abs(g - w) / scale) < RTOL, (g, w)


def assert_replicas_equal(step, n: int) -> None:
    for var in step.params + step.state:
        mine = var.get_value()
        for rank in range(1, n):
            np.testing.assert_array_equal(synk.get_value(rank, var), mine, err_msg=var.name)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_matches_single_process(fork, rule):
    """Two processes, rows split unevenly (37 over 2), several steps."""
    n = fork(2)
    params, x, y, loss = mlp("synk")
    step = make_train_function(loss, params, [x, y], rule, function_kwargs={"mode": MODE}, **hyper(rule))
    ref_params, ref = reference(rule)
    xs, ys = data(37)
    for _ in range(STEPS):
        got = step(xs, ys)
        want = ref(xs, ys)
        assert abs(got - float(want)) <= RTOL * abs(float(want))
    assert_close([p.get_value() for p in params], [p.get_value() for p in ref_params])
    assert_replicas_equal(step, n)
    # the step moved the parameters: the comparison is not trivially of the initial values
    assert not np.allclose(params[0].get_value(), mlp("init")[0][0].get_value())


@pytest.mark.parametrize("rule", ["adam", "momentum"])
def test_batch_and_num_slices(fork, rule):
    """Three processes, an index-list batch, slices inside each process, synk.data inputs."""
    n = fork(3)
    params, x, y, loss = mlp("synk")
    step = make_train_function(loss, params, [x, y], rule, function_kwargs={"mode": MODE}, **hyper(rule))
    ref_params, ref = reference(rule)
    xs, ys = data(50)
    x_data, y_data = synk.data(xs), synk.data(ys)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        idx = rng.choice(50, size=29, replace=False)
        got = step(x_data, y_data, batch=idx, num_slices=2)
        want = ref(xs[idx], ys[idx])
        assert abs(got - float(want)) <= RTOL * abs(float(want))
    assert_close([p.get_value() for p in params], [p.get_value() for p in ref_params])
    assert_replicas_equal(step, n)


def test_fewer_rows_than_processes(fork):
    """A process with no rows contributes nothing, and still applies the update."""
    n = fork(3)
    params, x, y, loss = mlp("synk")
    step = make_train_function(loss, params, [x, y], "adam", function_kwargs={"mode": MODE})
    ref_params, ref = reference("adam")
    xs, ys = data(2)
    for _ in range(STEPS):
        step(xs, ys)
        ref(xs, ys)
    assert_close([p.get_value() for p in params], [p.get_value() for p in ref_params])
    assert_replicas_equal(step, n)


def test_sliceable_shareds_and_batch_s(fork):
    """Training data held in sliceable shared variables, rows picked with batch_s."""
    n = fork(2)
    xs, ys = data(40)
    x_s = pytensor.shared(xs[:20], name="x_s")
    y_s = pytensor.shared(ys[:20], name="y_s")
    params, x, y, loss = mlp("synk")
    loss_s = pytensor.graph.clone_replace(loss, {x: x_s, y: y_s})
    step = make_train_function(loss_s, params, [], "rmsprop", sliceable_shareds=[x_s, y_s],
                               function_kwargs={"mode": MODE}, learning_rate=0.01)
    synk.scatter([x_s, y_s], [xs, ys])  # rank 0: rows 0..19, rank 1: rows 20..39
    ref_params = mlp("ref")[0]
    xr, yr = pt.dmatrix("xr"), pt.lvector("yr")
    loss_r = pytensor.graph.clone_replace(loss, {x: xr, y: yr, **dict(zip(params, ref_params))})
    ref = pytensor.function([xr, yr], loss_r, mode=MODE,
                            updates=plain_updates("rmsprop", loss_r, ref_params, learning_rate=0.01))
    picks = [np.array([0, 3, 5, 7, 11]), np.array([2, 4, 19])]  # uneven: 5 rows and 3 rows
    rows = np.concatenate([picks[0], 20 + picks[1]])
    for _ in range(STEPS):
        got = step(batch_s=picks)
        want = ref(xs[rows], ys[rows])
        assert abs(got - float(want)) <= RTOL * abs(float(want))
    assert_close([p.get_value() for p in params], [p.get_value() for p in ref_params])
    assert_replicas_equal(step, n)


def test_rules_by_function_and_errors(fork):
    fork(1)
    params, x, y, loss = mlp("synk")
    step = make_train_function(loss, params, [x, y], updates.sgd, learning_rate=0.5,
                               function_kwargs={"mode": MODE})
    assert step.rule == "sgd" and step.state == []
    assert step.grad_shared.get_value().shape == (4 * 5 + 4 + 4 * 3 + 1,)
    with pytest.raises(ValueError, match="unknown update rule 'adamw'"):
        make_train_function(loss, params, [x, y], "adamw")
    with pytest.raises(TypeError, match="update_rule must be"):
        make_train_function(loss, params, [x, y], lambda *a: None)
    with pytest.raises(TypeError, match="floating-point"):
        updates.sgd(loss, [pytensor.shared(np.zeros(3, dtype="int64"), name="k")], 0.1)
    with pytest.raises(ValueError, match="2 gradients for 3 parameters"):
        updates.adam([pt.zeros(1), pt.zeros(1)], params)
    with pytest.raises(TypeError, match="hyperparameters must be numbers"):
        updates.sgd(loss, params, learning_rate="fast")
