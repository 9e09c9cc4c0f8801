"""Function.as_op: a distributed function inside PyTensor graphs, against plain PyTensor."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from numpy.testing import assert_allclose
from scipy import optimize

import synkhronos as synk
from conftest import MODE, run_python


def _logistic(X, y, theta):
    eta = X @ theta
    return (y * eta - pt.log1p(pt.exp(eta))).sum()


def _logistic_value_and_grad(X, y, theta):
    """:func:`_logistic`'s value and gradient in numpy."""
    eta = X @ theta
    return float((y * eta - np.log1p(np.exp(eta))).sum()), X.T @ (y - 1.0 / (1.0 + np.exp(-eta)))


def _value_and_grad_function(op="sum", mode=MODE):
    """Summed log-likelihood and its gradient ("sum"), or their means over rows ("avg")."""
    X, y, theta = pt.dmatrix("X"), pt.dvector("y"), pt.dvector("theta")
    logp = _logistic(X, y, theta)
    if op == "avg":
        logp = logp / X.shape[0]
    logp.name = "logp" if op == "sum" else "mean_ll"  # (a mean named logp would warn)
    dlogp = pytensor.grad(logp, theta)
    dlogp.name = "d" + logp.name
    f = synk.function([X, y, theta], [(logp, op), (dlogp, op)], bcast_inputs=[theta], mode=mode)
    synk.distribute()
    return f, (X, y, theta)


def _data(rng, n, k):
    X = rng.standard_normal((n, k))
    y = (rng.random(n) < 0.5).astype(float)
    return X, y


def test_value_and_gradient_equal_plain_pytensor_over_random_cases(forked):
    f, (X, y, theta) = _value_and_grad_function()
    rng = np.random.default_rng(1)
    t = pt.dvector("t")
    c = pt.dscalar("c")
    for case in range(12):
        n, k = int(rng.integers(1, 60)), int(rng.integers(1, 5))
        Xv, yv = _data(rng, n, k)
        given = {X: synk.data(Xv) if case % 2 else Xv, "y": yv}
        op = f.as_op(given=given, grads={0: [1]})
        # an arbitrary graph around it: the gradient goes through the Op's declared gradient
        cost = c * op(t)[0] + pt.sin(t).sum()
        fn = pytensor.function([t, c], [cost, pytensor.grad(cost, t)], mode=MODE)
        ref_cost = c * _logistic(pt.constant(Xv), pt.constant(yv), t) + pt.sin(t).sum()
        ref = pytensor.function([t, c], [ref_cost, pytensor.grad(ref_cost, t)], mode=MODE)
        for _ in range(3):
            tv, cv = rng.standard_normal(k), float(rng.standard_normal())
            got, want = fn(tv, cv), ref(tv, cv)
            assert_allclose(got[0], want[0], rtol=1e-10, err_msg=f"case {case}: value")
            assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12, err_msg=f"case {case}: gradient")


def _count_calls(op) -> list:
    """A list that grows by one at each distributed call the Op makes."""
    calls = []
    real_call = op.fn

    class Counting:
        name, output_modes = real_call.name, real_call.output_modes

        def __call__(self, *args):
            calls.append(1)
            return real_call(*args)

    op.fn = Counting()
    return calls


def test_one_distributed_call_per_value_and_gradient(fork):
    fork(2)
    f, (X, y, theta) = _value_and_grad_function()
    Xv, yv = _data(np.random.default_rng(2), 30, 3)
    op = f.as_op(given={X: Xv, y: yv}, grads={0: [1]})
    calls = _count_calls(op)
    t = pt.dvector("t")
    value = op(t)[0]
    fn = pytensor.function([t], [value, pytensor.grad(value, t)], mode=MODE)
    fn(np.zeros(3))
    assert len(calls) == 1


def test_avg_outputs_and_scipy_optimize(fork):
    fork(2)
    f, (X, y, theta) = _value_and_grad_function(op="avg")
    rng = np.random.default_rng(3)
    Xv, yv = _data(rng, 41, 3)
    op = f.as_op(given={X: synk.data(Xv), y: synk.data(yv)}, grads={"mean_ll": ["dmean_ll"]})
    t = pt.dvector("t")
    value = -op(t)[0] + 0.5 * (t ** 2).sum()
    fn = pytensor.function([t], [value, pytensor.grad(value, t)], mode=MODE)
    got = optimize.minimize(fn, np.zeros(3), jac=True, method="L-BFGS-B").x
    ref_value = -_logistic(pt.constant(Xv), pt.constant(yv), t) / 41 + 0.5 * (t ** 2).sum()
    ref_fn = pytensor.function([t], [ref_value, pytensor.grad(ref_value, t)], mode=MODE)
    want = optimize.minimize(ref_fn, np.zeros(3), jac=True, method="L-BFGS-B").x
    assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_scattered_free_input_and_gather_output(fork):
    fork(2)
    x, w = pt.dmatrix("x"), pt.dvector("w")
    f = synk.function([x, w], [((x @ w), "gather"), ((x @ w).sum(), "sum")], bcast_inputs=[w], mode=MODE)
    op = f.as_op(given={"w": np.array([1.0, -2.0])})
    xs = pt.dmatrix("xs")
    rows, total = op(xs)
    assert rows.type.shape == (None,)
    fn = pytensor.function([xs], [rows, total], mode=MODE)
    a = np.arange(14.0).reshape(7, 2)
    got = fn(a)
    assert_allclose(got[0], a @ [1.0, -2.0])
    assert_allclose(got[1], (a @ [1.0, -2.0]).sum())


def test_bad_inputs_are_named(fork):
    fork(2)
    f, (X, y, theta) = _value_and_grad_function()
    Xv, yv = _data(np.random.default_rng(4), 10, 3)
    with pytest.raises(ValueError, match="'nope'.*expected exactly one"):
        f.as_op(given={"nope": Xv})
    with pytest.raises(TypeError, match="given must be a dict"):
        f.as_op(given=[Xv])
    with pytest.raises(TypeError, match="input 'X'.*ndim=2"):
        f.as_op(given={X: yv})
    with pytest.raises(TypeError, match="synk.data.*float32.*expects float64"):
        f.as_op(given={X: synk.data(Xv.astype(np.float32))})
    with pytest.raises(ValueError, match="one gradient output .* per free input"):
        f.as_op(given={X: Xv, y: yv}, grads={0: [1, 1]})
    with pytest.raises(ValueError, match="ndim 1; a gradient is declared for a scalar output only"):
        f.as_op(given={X: Xv, y: yv}, grads={1: [1]})
    with pytest.raises(ValueError, match="the input is scattered"):
        f.as_op(given={theta: np.zeros(3), y: yv}, grads={0: [1]})
    with pytest.raises(IndexError, match="output position 5 is out of range"):
        f.as_op(given={X: Xv, y: yv}, grads={5: [1]})
    op = f.as_op(given={X: Xv, y: yv}, grads={0: [1]})
    with pytest.raises(TypeError, match="input 'theta' of SynkOp.*expects ndim=1"):
        op(pt.dmatrix())
    with pytest.raises(TypeError, match="expects dtype float64, got .* of dtype complex128"):
        op(pt.zvector())
    with pytest.raises(ValueError, match=r"expects shape \(3,\)"):
        f2 = synk.function([theta], theta.sum(), bcast_inputs=[theta], mode=MODE)
        del f2
        op_static = f.as_op(given={X: Xv, y: yv})
        op_static.in_types[0] = pt.TensorType("float64", shape=(3,))
        op_static(pt.specify_shape(pt.dvector(), (4,)))
    with pytest.raises(TypeError, match="takes 1 inputs"):
        op(pt.dvector(), pt.dvector())
    # a float32 vector is cast up, as PyTensor would
    assert op(pt.fvector())[0].type.dtype == "float64"


def test_undeclared_gradient_is_an_error_naming_the_output(fork):
    fork(2)
    f, (X, y, theta) = _value_and_grad_function()
    Xv, yv = _data(np.random.default_rng(5), 10, 3)
    op = f.as_op(given={X: Xv, y: yv})
    t = pt.dvector("t")
    with pytest.raises(Exception, match="no gradient of its output 'logp'|no gradient"):
        pytensor.grad(op(t)[0], t)


def test_pickle_in_the_same_process_only(fork):
    fork(2)
    f, (X, y, theta) = _value_and_grad_function()
    Xv, yv = _data(np.random.default_rng(6), 10, 3)
    op = f.as_op(given={X: Xv, y: yv}, grads={0: [1]})
    assert pickle.loads(pickle.dumps(op)) is op


def test_jax_rendering_one_call_per_value_and_gradient():
    """jax.value_and_grad of a graph holding the Op: PyTensor's JAX backend renders it as a
    callback with a custom VJP, whose forward pass brings the gradient from the same call.
    In a fresh Python: JAX started in the test process would keep later tests' forks from
    binding GPUs or running JAX in their workers."""
    pytest.importorskip("jax")
    here = Path(__file__).resolve().parent
    done = run_python("""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        import pytensor
        import pytensor.tensor as pt
        from numpy.testing import assert_allclose
        import synkhronos as synk
        synk.fork(2, device="cpu")
        import jax
        from pytensor.graph.fg import FunctionGraph
        from pytensor.link.jax.dispatch import jax_funcify
        from synkhronos._integrations.graph_op import register_jax
        import test_as_op as T

        register_jax()
        f, (X, y, theta) = T._value_and_grad_function()
        rng = np.random.default_rng(7)
        Xv, yv = T._data(rng, 33, 3)
        op = f.as_op(given={X: synk.data(Xv), y: yv}, grads={0: [1]})
        calls = T._count_calls(op)
        t = pt.dvector("t")  # no static shape: the gradient's shape comes from the input
        cost = 3.0 * op(t)[0] + (t ** 2).sum()
        jfn = jax_funcify(FunctionGraph([t], [cost], clone=True))
        value, grad = jax.value_and_grad(lambda x: jfn(x)[0])(np.array([0.1, -0.2, 0.3]))
        assert len(calls) == 1, calls
        ref_cost = 3.0 * T._logistic(pt.constant(Xv), pt.constant(yv), t) + (t ** 2).sum()
        ref = pytensor.function([t], [ref_cost, pytensor.grad(ref_cost, t)], mode=T.MODE)(np.array([0.1, -0.2, 0.3]))
        assert_allclose(value, ref[0], rtol=1e-10)
        assert_allclose(grad, ref[1], rtol=1e-10)
        synk.close()
        print("OK")
    """, [here, here.parent], timeout=240, JAX_PLATFORMS="cpu")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]


def test_a_jax_mode_function_inside_jax_runs_the_masters_share_without_jax():
    """A function of JAX mode whose Op runs inside a JAX program: the master's share would run
    JAX inside XLA's callback, which JAX does not support (it hangs, now and then: seen with
    numpyro, jax-ml/jax#24255). There it runs a copy compiled without JAX, kept beside the JAX
    one: a jitted loop of 300 evaluations ends with PyTensor's values, the callback ran only
    the host copy, and a direct call still runs the JAX copy (and keeps its plan)."""
    pytest.importorskip("jax")
    here = Path(__file__).resolve().parent
    done = run_python("""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        import pytensor
        import pytensor.tensor as pt
        from numpy.testing import assert_allclose
        import synkhronos as synk
        synk.fork(3, device="cpu")
        import jax
        from pytensor.graph.fg import FunctionGraph
        from pytensor.link.jax.dispatch import jax_funcify
        from synkhronos.devices.jax_state import jax_linker
        import test_as_op as T

        f, (X, y, theta) = T._value_and_grad_function(mode="JAX")
        rng = np.random.default_rng(8)
        Xv, yv = T._data(rng, 41, 3)
        op = f.as_op(given={X: synk.data(Xv), y: yv}, grads={0: [1]})
        t = pt.dvector("t")
        jfn = jax_funcify(FunctionGraph([t], [op(t)[0]], clone=True))
        value_and_grad = jax.value_and_grad(lambda x: jfn(x)[0])

        @jax.jit
        def loop(x0):
            def step(i, carry):
                x, total = carry
                v, g = value_and_grad(x)
                return x - 1e-3 * g, total + v
            return jax.lax.fori_loop(0, 300, step, (x0, 0.0))

        x0 = np.array([0.1, -0.2, 0.3])
        x_end, total = loop(x0)
        x, want = x0, 0.0
        for _ in range(300):
            v, g = T._logistic_value_and_grad(Xv, yv, x)
            x, want = x - 1e-3 * g, want + v
        assert_allclose(x_end, x, rtol=1e-9)
        assert_allclose(total, want, rtol=1e-9)
        compiled = f._local._compiled
        assert any(k[-1] for k in compiled) and all(
            jax_linker(fn.maker.linker) != k[-1] for k, fn in compiled.items()), compiled
        direct = f(Xv, yv, x0)
        assert_allclose(direct[0], T._logistic_value_and_grad(Xv, yv, x0)[0], rtol=1e-10)
        assert f._planned, "the direct call keeps its plan"
        synk.close()
        print("OK")
    """, [here, here.parent], timeout=240, JAX_PLATFORMS="cpu")
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]


def test_an_averaged_log_probability_warns(fork):
    fork(2)
    x = pt.dvector("x")
    logp = (-0.5 * x ** 2).sum()
    logp.name = "logp"
    with pytest.warns(UserWarning, match="'logp' looks like a log-probability and is reduced with 'avg'"):
        synk.function([x], logp, mode=MODE)
    total = (-0.5 * x ** 2).sum()
    total.name = "logp"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synk.function([x], (total, "sum"), mode=MODE)
        mean = x.mean()
        mean.name = "x_mean"
        synk.function([x], mean, mode=MODE)
