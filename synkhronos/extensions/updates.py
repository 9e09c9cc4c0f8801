"""First-order update rules split for data parallelism around one all-reduce.

Every rule here returns a :class:`SplitUpdates`: two sets of PyTensor
updates and the one shared vector that travels between them.

1. ``grad_updates`` (for a :func:`synkhronos.function` over the training
   inputs): each process computes the gradient of its own rows and writes it,
   flattened into a single vector and scaled by its number of rows, into
   ``grad_shared``; the last element of that vector holds the row count.
2. ``synk.all_reduce(grad_shared, op="sum")``: one collective on one vector
   (cheaper than one per parameter), after which every process holds the
   row-weighted sum of all the gradients and the total row count.
3. ``param_updates`` (for a :func:`synkhronos.function` with no inputs): every
   process divides by the row count, so the gradient is the mean over the
   whole batch even when rows split unevenly, applies the rule to its own
   copy of the parameters and of the rule's state, and zeroes
   ``grad_shared``. Every process starts from the same values and applies the
   same arithmetic, so the replicas stay identical without sending any
   parameters.

:func:`synkhronos.extensions.train.make_train_function` wires the three steps
together. The rules follow Lasagne's definitions (``lasagne.updates``);
:func:`plain_updates` gives the same rule as ordinary single-process PyTensor
updates, for reference and for code that runs without synkhronos.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable

__all__ = ["SplitUpdates", "sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop",
           "adadelta", "adam", "adamax", "plain_updates", "resolve_rule", "RULES",
           "flatten_vars", "unflatten_vars", "vars_flat_size"]


@dataclasses.dataclass
class SplitUpdates:
    """The two halves of a data-parallel update rule and what joins them.

    Attributes:
        grad_updates: ``(grad_shared, expression, "sum")`` for the gradient
            function; the op ``"sum"`` makes ``num_slices`` accumulate
            correctly.
        param_updates: ``(shared, expression)`` pairs for the update function:
            the parameters, the rule's state, and the reset of ``grad_shared``.
        grad_shared: the flat gradient vector (parameters' total size + 1) to
            all-reduce with ``op="sum"`` between the two functions.
        params: the parameters, in order.
        state: the rule's own shared variables (velocities, accumulators, step
            count), which every process keeps in step like the parameters.
    """

    grad_updates: list
    param_updates: list
    grad_shared: SharedVariable
    params: list
    state: list


# ---------------------------------------------------------------------------
# Flattening: one vector for all the gradients, so one collective moves them.


def flatten_vars(variables) -> Variable:
    """Concatenate PyTensor variables, each flattened, into one vector.

    Args:
        variables: list of tensor variables (any shapes).

    Returns:
        A 1-d tensor variable.
    """
    return pt.concatenate([pt.flatten(v) for v in variables])


def vars_flat_size(variables) -> int:
    """Total number of elements of the current values of shared variables.

    Args:
        variables: list of shared variables.

    Returns:
        The sum of their sizes.
    """
    return int(sum(np.size(v.get_value(borrow=True)) for v in variables))


def unflatten_vars(flat, variables) -> list:
    """Views of a flat vector shaped like each shared variable in turn.

    Args:
        flat: 1-d tensor variable with at least :func:`vars_flat_size` elements.
        variables: shared variables giving the shapes, in order.

    Returns:
        A list of tensor variables, one per shared variable.
    """
    out, i = [], 0
    for v in variables:
        shape = np.shape(v.get_value(borrow=True))
        size = int(np.prod(shape, dtype=np.int64))
        out.append(pt.reshape(flat[i:i + size], shape))
        i += size
    return out


# ---------------------------------------------------------------------------
# Validation and small helpers.


def _check_params(params) -> list:
    if isinstance(params, SharedVariable):
        params = [params]
    if not isinstance(params, (list, tuple)) or not params:
        raise TypeError(f"params must be a non-empty list of PyTensor shared variables, got {params!r}")
    for p in params:
        if not isinstance(p, SharedVariable):
            raise TypeError(f"params must be PyTensor shared variables, got {p!r}")
        if not np.issubdtype(np.dtype(p.type.dtype), np.floating):
            raise TypeError(f"parameter {p.name or p!r} has dtype {p.type.dtype}; "
                            "update rules need floating-point parameters")
    ids = [id(p) for p in params]
    if len(set(ids)) != len(ids):
        raise ValueError(f"params lists a shared variable twice: {[p.name for p in params]}")
    return list(params)


def _grads(loss_or_grads, params) -> list:
    if isinstance(loss_or_grads, (list, tuple)):
        if len(loss_or_grads) != len(params):
            raise ValueError(f"got {len(loss_or_grads)} gradients for {len(params)} parameters")
        return list(loss_or_grads)
    if not isinstance(loss_or_grads, Variable) or loss_or_grads.type.ndim != 0:
        raise TypeError(f"loss_or_grads must be a scalar PyTensor loss or a list of gradients, "
                        f"got {loss_or_grads!r}")
    return cast(list, pytensor.grad(loss_or_grads, params))  # (params a list: a list)


def _const(value, dtype):
    """A hyperparameter as a tensor of ``dtype``: shared variables stay live (schedules)."""
    if isinstance(value, Variable):
        return pt.cast(value, dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"hyperparameters must be numbers or PyTensor variables, got {value!r}")
    return pt.constant(np.asarray(value, dtype=dtype))


def _like(p, suffix: str, value=0.0) -> SharedVariable:
    v = p.get_value(borrow=True)
    return pytensor.shared(np.full(np.shape(v), value, dtype=p.type.dtype),
                           name=f"{p.name or 'param'}_{suffix}", shape=p.type.shape)


def _common_dtype(params) -> str:
    return str(np.result_type(*[np.dtype(p.type.dtype) for p in params]))


def _cast_updates(pairs) -> list:
    return [(var, pt.cast(expr, var.type.dtype)) for var, expr in pairs]


# ---------------------------------------------------------------------------
# The rules themselves: (gradients, params, hyperparameters) -> (updates, state).
# Shared by the data-parallel split and by plain_updates.


def _sgd_rule(grads, params, learning_rate):
    out = []
    for p, g in zip(params, grads):
        lr = _const(learning_rate, p.type.dtype)
        out.append((p, p - lr * g))
    return out, []


def _momentum_rule(grads, params, learning_rate, momentum=0.9):
    out, state = [], []
    for p, g in zip(params, grads):
        lr, mu = _const(learning_rate, p.type.dtype), _const(momentum, p.type.dtype)
        velocity = _like(p, "velocity")
        v_new = mu * velocity - lr * g
        out += [(velocity, v_new), (p, p + v_new)]
        state.append(velocity)
    return out, state


def _nesterov_rule(grads, params, learning_rate, momentum=0.9):
    out, state = [], []
    for p, g in zip(params, grads):
        lr, mu = _const(learning_rate, p.type.dtype), _const(momentum, p.type.dtype)
        velocity = _like(p, "velocity")
        v_new = mu * velocity - lr * g
        out += [(velocity, v_new), (p, p + mu * v_new - lr * g)]
        state.append(velocity)
    return out, state


def _adagrad_rule(grads, params, learning_rate=1.0, epsilon=1e-6):
    out, state = [], []
    for p, g in zip(params, grads):
        lr, eps = _const(learning_rate, p.type.dtype), _const(epsilon, p.type.dtype)
        accu = _like(p, "accu")
        accu_new = accu + g ** 2
        out += [(accu, accu_new), (p, p - lr * g / pt.sqrt(accu_new + eps))]
        state.append(accu)
    return out, state


def _rmsprop_rule(grads, params, learning_rate=1.0, rho=0.9, epsilon=1e-6):
    out, state = [], []
    for p, g in zip(params, grads):
        dt = p.type.dtype
        lr, r, eps = _const(learning_rate, dt), _const(rho, dt), _const(epsilon, dt)
        accu = _like(p, "accu")
        accu_new = r * accu + (1 - r) * g ** 2
        out += [(accu, accu_new), (p, p - lr * g / pt.sqrt(accu_new + eps))]
        state.append(accu)
    return out, state


def _adadelta_rule(grads, params, learning_rate=1.0, rho=0.95, epsilon=1e-6):
    out, state = [], []
    for p, g in zip(params, grads):
        dt = p.type.dtype
        lr, r, eps = _const(learning_rate, dt), _const(rho, dt), _const(epsilon, dt)
        accu, delta_accu = _like(p, "accu"), _like(p, "delta_accu")
        accu_new = r * accu + (1 - r) * g ** 2
        step = g * pt.sqrt(delta_accu + eps) / pt.sqrt(accu_new + eps)
        delta_new = r * delta_accu + (1 - r) * step ** 2
        out += [(accu, accu_new), (p, p - lr * step), (delta_accu, delta_new)]
        state += [accu, delta_accu]
    return out, state


def _adam_rule(grads, params, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8):
    dt = _common_dtype(params)
    t_prev = pytensor.shared(np.asarray(0, dtype=dt), name="adam_t")
    t = t_prev + 1
    b1, b2 = _const(beta1, dt), _const(beta2, dt)
    a_t = _const(learning_rate, dt) * pt.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    out, state = [(t_prev, t)], [t_prev]
    for p, g in zip(params, grads):
        eps = _const(epsilon, p.type.dtype)
        m_prev, v_prev = _like(p, "m"), _like(p, "v")
        m_t = b1 * m_prev + (1 - b1) * g
        v_t = b2 * v_prev + (1 - b2) * g ** 2
        out += [(m_prev, m_t), (v_prev, v_t), (p, p - a_t * m_t / (pt.sqrt(v_t) + eps))]
        state += [m_prev, v_prev]
    return out, state


def _adamax_rule(grads, params, learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8):
    dt = _common_dtype(params)
    t_prev = pytensor.shared(np.asarray(0, dtype=dt), name="adamax_t")
    t = t_prev + 1
    b1, b2 = _const(beta1, dt), _const(beta2, dt)
    a_t = _const(learning_rate, dt) / (1 - b1 ** t)
    out, state = [(t_prev, t)], [t_prev]
    for p, g in zip(params, grads):
        eps = _const(epsilon, p.type.dtype)
        m_prev, u_prev = _like(p, "m"), _like(p, "u")
        m_t = b1 * m_prev + (1 - b1) * g
        u_t = pt.maximum(b2 * u_prev, abs(g))
        out += [(m_prev, m_t), (u_prev, u_t), (p, p - a_t * m_t / (u_t + eps))]
        state += [m_prev, u_prev]
    return out, state


# ---------------------------------------------------------------------------
# The split.


def _split(loss_or_grads, params, weight, rule, hyper) -> SplitUpdates:
    params = _check_params(params)
    grads = _grads(loss_or_grads, params)
    dtype = _common_dtype(params)
    grad_shared = pytensor.shared(np.zeros(vars_flat_size(params) + 1, dtype=dtype),
                                  name="synk_flat_grad")
    w = pt.constant(np.asarray(1, dtype=dtype)) if weight is None else pt.cast(weight, dtype)
    if w.type.ndim != 0:
        raise TypeError(f"weight must be a scalar (the number of rows, e.g. x.shape[0]), got {weight!r}")
    flat = pt.concatenate([pt.flatten(pt.cast(g, dtype)) * w for g in grads] + [pt.reshape(w, (1,))])
    total = grad_shared[-1]
    # a call on no rows at all leaves a zero sum: divide by one, not by zero
    total = pt.switch(pt.eq(total, 0), pt.ones_like(total), total)
    mean_grads = [pt.cast(g / total, p.type.dtype)
                  for g, p in zip(unflatten_vars(grad_shared, params), params)]
    param_updates, state = rule(mean_grads, params, **hyper)
    param_updates = _cast_updates(param_updates)
    # a process that computes on no rows next time must contribute zeros
    param_updates.append((grad_shared, pt.zeros_like(grad_shared)))
    return SplitUpdates([(grad_shared, flat, "sum")], param_updates, grad_shared, params, state)


_DOC_TAIL = """
    Args:
        loss_or_grads: the scalar loss of one process's rows (a mean over its
            rows), or a list of gradients, one per parameter.
        params: the shared variables to train (floating point).
        weight: symbolic number of rows the loss was averaged over in this
            process, e.g. ``x.shape[0]``. Each process's gradient is weighted
            by it, so the result is the mean over the whole batch even when
            the rows split unevenly. ``None`` weighs processes equally.
{hyper}
    Returns:
        A :class:`SplitUpdates`.

    Raises:
        TypeError: params that are not floating-point shared variables, a
            loss that is not a scalar, a hyperparameter that is not a number.
        ValueError: as many gradients as parameters were not given.
"""


def _doc(summary: str, hyper: str) -> str:
    return summary + "\n" + _DOC_TAIL.format(hyper=hyper)


def sgd(loss_or_grads, params, learning_rate, weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _sgd_rule, dict(learning_rate=learning_rate))


def momentum(loss_or_grads, params, learning_rate, momentum=0.9, weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _momentum_rule,
                  dict(learning_rate=learning_rate, momentum=momentum))


def nesterov_momentum(loss_or_grads, params, learning_rate, momentum=0.9, weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _nesterov_rule,
                  dict(learning_rate=learning_rate, momentum=momentum))


def adagrad(loss_or_grads, params, learning_rate=1.0, epsilon=1e-6, weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _adagrad_rule,
                  dict(learning_rate=learning_rate, epsilon=epsilon))


def rmsprop(loss_or_grads, params, learning_rate=1.0, rho=0.9, epsilon=1e-6, weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _rmsprop_rule,
                  dict(learning_rate=learning_rate, rho=rho, epsilon=epsilon))


def adadelta(loss_or_grads, params, learning_rate=1.0, rho=0.95, epsilon=1e-6, weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _adadelta_rule,
                  dict(learning_rate=learning_rate, rho=rho, epsilon=epsilon))


def adam(loss_or_grads, params, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
         weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _adam_rule,
                  dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon))


def adamax(loss_or_grads, params, learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8,
           weight=None) -> SplitUpdates:
    return _split(loss_or_grads, params, weight, _adamax_rule,
                  dict(learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon))


sgd.__doc__ = _doc(
    "Stochastic gradient descent: ``p -= learning_rate * g``.",
    "        learning_rate: step size (a number or a shared scalar).")
momentum.__doc__ = _doc(
    "SGD with classical momentum: ``v = momentum * v - learning_rate * g; p += v``.",
    "        learning_rate: step size.\n        momentum: decay of the velocity.")
nesterov_momentum.__doc__ = _doc(
    "SGD with Nesterov momentum: ``v = momentum * v - learning_rate * g; "
    "p += momentum * v - learning_rate * g``.",
    "        learning_rate: step size.\n        momentum: decay of the velocity.")
adagrad.__doc__ = _doc(
    "Adagrad: steps scaled by the root of the running sum of squared gradients.",
    "        learning_rate: step size.\n        epsilon: added under the root for stability.")
rmsprop.__doc__ = _doc(
    "RMSProp: steps scaled by the root of a moving average of squared gradients.",
    "        learning_rate: step size.\n        rho: decay of the moving average.\n"
    "        epsilon: added under the root for stability.")
adadelta.__doc__ = _doc(
    "Adadelta: steps scaled by the ratio of moving averages of squared steps and gradients.",
    "        learning_rate: multiplies the step (1.0 in the paper).\n"
    "        rho: decay of the moving averages.\n        epsilon: added under the roots.")
adam.__doc__ = _doc(
    "Adam: bias-corrected moving averages of the gradient and its square.",
    "        learning_rate: step size.\n        beta1, beta2: decays of the two averages.\n"
    "        epsilon: added to the denominator for stability.")
adamax.__doc__ = _doc(
    "Adamax: Adam with the infinity norm in place of the squared average.",
    "        learning_rate: step size.\n        beta1, beta2: decays of the average and the norm.\n"
    "        epsilon: added to the denominator for stability.")

#: The rules by name, as :func:`synkhronos.extensions.train.make_train_function` accepts them.
RULES = {f.__name__: f for f in (sgd, momentum, nesterov_momentum, adagrad, rmsprop, adadelta,
                                 adam, adamax)}

_CORES = {"sgd": _sgd_rule, "momentum": _momentum_rule, "nesterov_momentum": _nesterov_rule,
          "adagrad": _adagrad_rule, "rmsprop": _rmsprop_rule, "adadelta": _adadelta_rule,
          "adam": _adam_rule, "adamax": _adamax_rule}


def resolve_rule(rule) -> str:
    """The name of an update rule given as a name or as one of this module's functions.

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor one of the rules.
    """
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown update rule {rule!r}; expected one of {sorted(RULES)}")
        return rule
    for name, fn in RULES.items():
        if rule is fn:
            return name
    raise TypeError(f"update_rule must be a rule name or one of synkhronos.extensions.updates' "
                    f"rules ({', '.join(sorted(RULES))}), got {rule!r}")


def plain_updates(rule, loss_or_grads, params, **hyperparameters) -> list:
    """The same rule as ordinary, single-process PyTensor updates.

    For a plain ``pytensor.function(inputs, loss, updates=...)``: no flat
    vector, no collective. Useful as a reference for the data-parallel step
    and for code that also runs without synkhronos.

    Args:
        rule: a rule name (``"adam"``) or function (:func:`adam`).
        loss_or_grads: the scalar loss, or a list of gradients.
        params: the shared variables to train.
        **hyperparameters: as for the rule (``learning_rate=...``).

    Returns:
        A list of ``(shared, expression)`` pairs, the rule's new state
        variables included.

    Raises:
        ValueError, TypeError: an unknown rule or bad arguments, as for the rules.
    """
    name = resolve_rule(rule)
    params = _check_params(params)
    grads = _grads(loss_or_grads, params)
    pairs, _ = _CORES[name](grads, params, **hyperparameters)
    return _cast_updates(pairs)
