"""Rewrites of a PyTensor graph that XLA compiles for the CPU, to forms it runs faster.

Applied by :class:`synkhronos.pymc.JaxValueAndGrad` to each process's share of a
data-parallel PyMC model, after JAX mode's own rewrites (which would fold the new
forms back). Measured on one core of an Intel Xeon with AVX-512 (2026-11-26,
jaxlib 0.12, float64), value and gradient of PyMC's Bernoulli(``logit_p``) log-
likelihood over ``a + X @ b`` at 100,000 rows and 10 columns, the three rewrites
in turn, interleaved in one process: 5.9 ms, 4.4 ms, 3.7 ms (medians of 12
rounds), with the same value to the last digit.

* :func:`switch_of_log_sigmoids`. PyMC writes that log-likelihood as
  ``switch(y, -softplus(-x), -softplus(x))``: two softplus per row, and a select
  of two computed values, which XLA's loop does not vectorize. ``-softplus(-x) =
  min(x, 0) - log1p(exp(-|x|))`` and ``-softplus(x) = -max(x, 0) - log1p(exp(-|x|))``
  share their transcendental part; the select is left with two cheap values.
* :func:`softplus_by_abs`. PyTensor renders ``softplus`` in JAX as a chain of
  ``where`` over four ranges, every branch of which XLA evaluates: the sum of it
  over 100,000 values took 2.3 ms against 0.46 ms for ``max(x, 0) +
  log1p(exp(-|x|))`` (the same to 2 ulp). Its gradient through JAX has no
  ``where`` over an overflowing ``exp`` either: past a logit of about 709
  PyTensor's rendering gives a NaN gradient, this one the right one.
* :func:`sum_of_switch_less_log`. XLA's loop fusions do not vectorize ``log1p``
  (1.2 ms for 100,000 values written out, 0.16 ms summed): a log term summed
  apart goes to YNNPACK's reduction, which does. It changes one thing: a row out
  of the model's support (``-inf``) whose log term is NaN makes the sum NaN
  instead of ``-inf``; both are rejected by every sampler and optimizer, and
  PyMC's own check raises on such a row outside JAX.

Two more for the parameter checks PyMC turns into ``switch(cond, logp, -inf)``
(which synkhronos.pymc keeps, so that a parameter out of its support gives -inf
as in PyMC, where PyTensor's JAX rendering drops a check and gives NaN):

* :func:`bounded_link_checks`: ``sigmoid(x) >= 0``, ``sigmoid(x) <= 1`` and
  ``exp(x) >= 0`` (a logit or log link's ``0 <= p <= 1``, ``mu >= 0``) are
  ``~isnan(x)``, exactly: no link computed again for every row.
* :func:`sum_of_guarded`: ``sum(switch(g, x, -inf))`` with one condition for all
  rows is ``switch(g, sum(x), -inf)``, whose inner sum the third rewrite knows.

Measured on one core of an AMD EPYC (2026-11-27, jaxlib 0.12), Bernoulli at
100,000 rows: 4.59 ms with the checks, 4.23 ms without them.

All are tested against the old graph on random and extreme inputs
(``tests/test_xla_rewrites.py``).

**Per-row matrices feature-major.** XLA's float64 dot on the CPU is slow for the
shape of a regression, a tall matrix of rows by a few features: on one core of an
AMD EPYC (2026-11-27, jaxlib 0.12, 100,000 rows by 10 features, best of 9 rounds,
inputs already JAX arrays) ``X @ b`` took 0.35-0.52 ms and the gradient's ``g @ X``
1.1-1.2 ms, where the same products on the matrix stored transposed (features
first, ``b @ XT`` and ``XT @ g``) took 0.23-0.28 ms each; on the whole value and
gradient of the Poisson share of ``bench/pymc_bench.py`` 1.4 ms against 2.2 ms.
:class:`FeatureMajor` is the matrix read from such storage (each process's rows
of its input hold the memory of their transpose, :func:`feature_major` lays them
out) and :func:`dot_of_transposed` writes ``dot(X, w)`` on it as ``dot(w.T, XT).T``.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import pytensor.scalar as ps
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.scalar.math import Softplus
from pytensor.raise_op import CheckAndRaise
from pytensor.tensor.basic import ARange, get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.math import Dot, Sum
from pytensor.tensor.variable import TensorConstant, TensorVariable

__all__ = ["rewrite_for_xla", "prepare_for_xla", "render_for_xla", "FeatureMajor", "feature_major", "read_by_dots_only"]


def _scalar_op(var, kind):
    """The input of ``var`` when ``var`` is an Elemwise of scalar op ``kind``, else None."""
    owner = var.owner
    if owner is not None and isinstance(owner.op, Elemwise) and isinstance(owner.op.scalar_op, kind):
        return owner.inputs
    return None


def _as_output(node, new):
    """``[new]`` as the replacement of ``node``'s output, or None where its type cannot be."""
    old = node.outputs[0]
    if new.type.dtype != old.type.dtype or new.type.ndim != old.type.ndim:
        return None
    try:
        return [old.type.filter_variable(new, allow_convert=True)]
    except TypeError:
        return None


def _zero(x):
    return pt.constant(np.zeros((), dtype=x.type.dtype))


def _log1p_exp_neg_abs(x):
    """``log1p(exp(-|x|))``: the part of ``softplus(x)`` and ``softplus(-x)`` past ``max(+-x, 0)``."""
    return pt.log1p(pt.exp(-pt.abs(x)))


def _neg_softplus(var):
    """``x`` when ``var`` is ``-softplus(x)``, else None."""
    inner = _scalar_op(var, ps.Neg)
    if inner is None:
        return None
    arg = _scalar_op(inner[0], Softplus)
    return None if arg is None else arg[0]


@node_rewriter([Elemwise])
def switch_of_log_sigmoids(fgraph, node):
    """``switch(c, -softplus(-x), -softplus(x))`` -> ``switch(c, min(x, 0), -max(x, 0))
    - log1p(exp(-|x|))`` (and the mirrored switch): one exp and one log1p, and a
    select of two cheap values."""
    if not isinstance(node.op.scalar_op, ps.Switch):
        return None
    cond, when_true, when_false = node.inputs
    for first, second, flip in ((when_true, when_false, False), (when_false, when_true, True)):
        x, neg_x = _neg_softplus(second), _neg_softplus(first)
        if x is None or neg_x is None:
            continue
        negated = _scalar_op(neg_x, ps.Neg)
        if negated is None or negated[0] is not x:
            continue
        below, above = pt.minimum(x, _zero(x)), -pt.maximum(x, _zero(x))  # -softplus(-x), -softplus(x) less it
        picked = pt.switch(cond, above, below) if flip else pt.switch(cond, below, above)
        return _as_output(node, picked - _log1p_exp_neg_abs(x))
    return None


@node_rewriter([Elemwise])
def softplus_by_abs(fgraph, node):
    """``softplus(x)`` -> ``max(x, 0) + log1p(exp(-|x|))``: no ranges, one exp."""
    if not isinstance(node.op.scalar_op, Softplus):
        return None
    [x] = node.inputs
    if not x.type.dtype.startswith("float"):
        return None
    return _as_output(node, pt.maximum(x, _zero(x)) + _log1p_exp_neg_abs(x))


def _infinite(var) -> bool:
    try:
        return bool(np.isinf(get_underlying_scalar_constant_value(var)))
    except NotScalarConstantError:
        return False


@node_rewriter([Sum])
def sum_of_switch_less_log(fgraph, node):
    """``sum(switch(c, -inf, a - log_term))`` -> ``sum(switch(c, -inf, a)) - sum(log_term)``,
    through a ``CheckAndRaise`` between the sum and the switch (kept, around the new sum)
    and a row mask (both new sums masked alike, see :func:`_unmasked`).

    A row where ``c`` holds gives ``-inf`` either way, as long as ``log_term`` is finite
    there; where it is NaN the new sum is NaN where the old one was ``-inf`` (an input
    already out of the model's support). XLA's loop fusions do not vectorize
    ``log``/``log1p``; in a sum of its own the log goes to YNNPACK, which does."""
    if node.op.axis is not None and len(node.op.axis) != node.inputs[0].type.ndim:
        return None
    inner, check = node.inputs[0], None
    if inner.owner is not None and isinstance(inner.owner.op, CheckAndRaise):
        check = inner.owner
        inner = check.inputs[0]
    mask, inner = _unmasked(inner)
    parts = _scalar_op(inner, ps.Switch)
    if parts is None:
        return None
    cond, when_true, when_false = parts
    diff = _scalar_op(when_false, ps.Sub)
    if not _infinite(when_true) or diff is None:
        return None
    kept, log_term = diff
    if _scalar_op(log_term, (ps.Log1p, ps.Log)) is None or log_term.type.broadcastable != inner.type.broadcastable:
        return None
    dtype = node.outputs[0].type.dtype
    new = (pt.sum(_masked(mask, pt.switch(cond, when_true, kept)), dtype=dtype)
           - pt.sum(_masked(mask, log_term), dtype=dtype))
    if check is not None:
        new = check.op(new, *check.inputs[1:])
    return _as_output(node, new)


def _log_part(var):
    """``(k, log_term)`` where ``var`` is ``log_term`` or a product of it and row-constant
    factors ``k`` (a list, all dimensions broadcastable), ``log_term`` a log or log1p; else None."""
    if _scalar_op(var, (ps.Log1p, ps.Log)) is not None:
        return [], var
    factors = _scalar_op(var, ps.Mul)
    if factors is None:
        return None
    rows = [f for f in factors if not all(f.type.broadcastable)]
    if len(rows) != 1 or _scalar_op(rows[0], (ps.Log1p, ps.Log)) is None:
        return None
    return [f for f in factors if f is not rows[0]], rows[0]


def _linear_terms(var, sign, depth=0) -> list:
    """``var`` as a signed sum: ``[(sign, term), ...]`` through ``+``, ``-`` and negation."""
    if depth < 32:
        if (parts := _scalar_op(var, ps.Add)) is not None:
            return [t for p in parts for t in _linear_terms(p, sign, depth + 1)]
        if (parts := _scalar_op(var, ps.Sub)) is not None:
            return _linear_terms(parts[0], sign, depth + 1) + _linear_terms(parts[1], -sign, depth + 1)
        if (parts := _scalar_op(var, ps.Neg)) is not None:
            return _linear_terms(parts[0], -sign, depth + 1)
    return [(sign, var)]


def _scalar(var):
    return var.reshape(()) if var.type.ndim else var


def _isfinite(var):
    """``pt.isfinite(var)``, which PyTensor 2 lacks: there, neither NaN nor an infinity."""
    isfinite = getattr(pt, "isfinite", None)
    return isfinite(var) if isfinite is not None else ~(pt.isnan(var) | pt.isinf(var))


@node_rewriter([Sum])
def sum_of_log_terms(fgraph, node):
    """``sum(a - k * log_term)`` -> ``sum(a) - k * sum(log_term)`` (and ``+``, and n-ary sums of
    terms), ``k`` row-constant factors, through a row mask (see :func:`_unmasked`): the log
    term summed apart, where YNNPACK's reduction vectorizes it (a StudentT share's
    ``log1p``, whose value and gradient then took 1.6-2.1 ms against 2.8-4.0 ms at 100,000
    rows, one core of an AMD EPYC, 2026-11-27). The same value up to rounding, and the same
    infinity or NaN where a row holds one; where a factor ``k`` is not finite the new sum is
    NaN (the old one is NaN or an infinity there: ``k * 0`` is NaN in a row, and a share of
    no rows of its own gave 0)."""
    if node.op.axis is not None and len(node.op.axis) != node.inputs[0].type.ndim:
        return None
    mask, inner = _unmasked(node.inputs[0])
    signed = _linear_terms(inner, 1)
    if len(signed) < 2:
        return None
    logs = [(sign, _log_part(term)) for sign, term in signed]
    if not any(lp is not None and lp[1].type.broadcastable == inner.type.broadcastable for _, lp in logs):
        return None
    dtype = node.outputs[0].type.dtype
    rest, total, full = [], None, None
    for (sign, term), (_, lp) in zip(signed, logs):
        if lp is None or lp[1].type.broadcastable != inner.type.broadcastable:
            rest.append(term if sign > 0 else -term)
            continue
        factors, log_term = lp
        full = log_term if full is None else full
        part = pt.sum(_masked(mask, log_term), dtype=dtype)
        if factors:  # a factor that is not finite: NaN (the old sum is NaN or an infinity there)
            k = pt.mul(*[_scalar(f) for f in factors]) if len(factors) > 1 else _scalar(factors[0])
            part = pt.switch(_isfinite(k), k * part, pt.constant(np.nan, dtype=dtype))
        part = part if sign > 0 else -part
        total = part if total is None else total + part
    if rest:
        kept = rest[0] if len(rest) == 1 else pt.add(*rest)
        if kept.type.broadcastable != inner.type.broadcastable:  # row-constant: one per row, as before
            # (the shape of a log term, computed anyway: there is one, checked above)
            kept = pt.broadcast_to(kept, cast(TensorVariable, full).shape)
        total = pt.sum(_masked(mask, kept), dtype=dtype) + total
    return _as_output(node, pt.cast(total, dtype))


def _constant_equal(var, value) -> bool:
    try:
        return bool(np.all(get_underlying_scalar_constant_value(var) == value))
    except NotScalarConstantError:
        return False


#: ``cmp(link(x), c)`` that holds for every ``x`` but NaN: (comparison, link, constant).
_ALWAYS_BUT_NAN = ((ps.GE, ps.Sigmoid, 0.0), (ps.LE, ps.Sigmoid, 1.0), (ps.GE, ps.Exp, 0.0))


@node_rewriter([Elemwise])
def bounded_link_checks(fgraph, node):
    """``sigmoid(x) >= 0``, ``sigmoid(x) <= 1``, ``exp(x) >= 0`` -> ``~isnan(x)``: exactly the
    same truth (each fails only where ``x`` is NaN), without a sigmoid or an exp per row.
    PyMC's parameter checks of a logit or log link (``0 <= p <= 1``, ``mu >= 0``), turned
    into -inf switches, computed every row's link twice more."""
    for cmp, link, bound in _ALWAYS_BUT_NAN:
        if not isinstance(node.op.scalar_op, cmp):
            continue
        value, const = node.inputs
        inner = _scalar_op(value, link)
        if inner is None or not _constant_equal(const, bound):
            continue
        [x] = inner
        if x.type.broadcastable != node.outputs[0].type.broadcastable:
            continue
        return _as_output(node, pt.invert(pt.isnan(x)))
    return None


@node_rewriter([Sum])
def sum_of_guarded(fgraph, node):
    """``sum(switch(g, x, -inf))`` with ``g`` one condition for all rows (a parameter check)
    -> ``switch(g, sum(x), -inf)``: the sum inside is the one the other rewrites know.
    The same value: where ``g`` fails both are -inf (a share of no rows aside, whose -inf
    adds to the -inf of the shares that hold rows). Through a row mask (see
    :func:`_unmasked`): ``sum(switch(m, switch(g, x, -inf), 0))`` -> ``switch(g,
    sum(switch(m, x, 0)), -inf)``."""
    if node.op.axis is not None and len(node.op.axis) != node.inputs[0].type.ndim:
        return None
    mask, inner = _unmasked(node.inputs[0])
    parts = _scalar_op(inner, ps.Switch)
    if parts is None:
        return None
    guard, kept, other = parts
    if not all(guard.type.broadcastable) or not _infinite(other) or not _constant_equal(other, -np.inf):
        return None
    dtype = node.outputs[0].type.dtype
    one = guard.reshape(()) if guard.type.ndim else guard
    return _as_output(node, pt.switch(one, pt.sum(_masked(mask, kept), dtype=dtype),
                                      pt.constant(-np.inf, dtype=dtype)))


def _unmasked(var):
    """``(m, x)`` where ``var`` is ``switch(m, x, 0)`` (a share's row mask: its own rows, not
    the padding), else ``(None, var)``."""
    parts = _scalar_op(var, ps.Switch)
    if parts is not None and _constant_equal(parts[2], 0) and parts[1].type.broadcastable == var.type.broadcastable:
        return parts[0], parts[1]
    return None, var


def _masked(mask, var):
    return var if mask is None else pt.switch(mask, var, _zero(var))


class FeatureMajor(Op):
    """``(n, k)`` storage of an ``(n, k)`` per-row matrix ``X`` laid out by
    :func:`feature_major` -> ``X.T``, an ``(k, n)`` matrix (in JAX a reshape: no copy).

    The storage holds, for one process's rows, the memory of ``X.T`` in C order;
    ``FeatureMajor()(d).T`` is ``X``. Rows from two processes' blocks are meaningless
    together: the input must be exactly one process's rows as laid out."""

    __props__ = ()

    # an Op's own inputs, as PyTensor's Ops take them (Op.make_node's *inputs is the general form)
    def make_node(self, stored):  # type: ignore[override]
        stored = pt.as_tensor_variable(stored)
        if stored.type.ndim != 2:
            raise TypeError(f"FeatureMajor takes a matrix, got {stored} of {stored.type.ndim} dimensions")
        n, k = stored.type.shape
        return Apply(self, [stored], [pt.tensor(dtype=stored.type.dtype, shape=(k, n))])

    def perform(self, node, inputs, outputs):
        (stored,) = inputs
        outputs[0][0] = np.ascontiguousarray(stored).reshape(stored.shape[1], stored.shape[0])


def register_feature_major() -> None:
    """Teach PyTensor's JAX backend :class:`FeatureMajor` (imports JAX)."""
    from pytensor.link.jax.dispatch import jax_funcify

    if FeatureMajor not in jax_funcify.registry:
        jax_funcify.register(FeatureMajor)(lambda op, node=None, **kwargs: _jax_feature_major)


def _jax_feature_major(stored):
    return stored.reshape(stored.shape[1], stored.shape[0])


@node_rewriter([FeatureMajor])
def feature_major_as_reshape(fgraph, node):
    """:class:`FeatureMajor` as PyTensor's own reshape (a view of C-ordered storage in
    every backend), for a graph laid out for JAX that runs without it."""
    (stored,) = node.inputs
    return [pt.reshape(stored, (stored.shape[1], stored.shape[0]))]


def feature_major(x: np.ndarray, bounds, out: np.ndarray | None = None) -> np.ndarray:
    """``x`` (rows by features) laid out for :class:`FeatureMajor`: for each ``(lo, hi)``
    of ``bounds`` (the processes' rows, in order, covering ``x``), rows ``lo:hi`` of
    the result hold the memory of ``x[lo:hi].T`` in C order."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"feature_major takes a matrix, got shape {x.shape}")
    if [lo for lo, _ in bounds[1:]] != [hi for _, hi in bounds[:-1]] or (bounds and (
            bounds[0][0] != 0 or bounds[-1][1] != len(x))):
        raise ValueError(f"bounds {list(bounds)} do not cover the {len(x)} rows in order")
    out = np.empty_like(x, order="C") if out is None else out
    for lo, hi in bounds:
        out[lo:hi].reshape(x.shape[1], hi - lo)[...] = x[lo:hi].T
    return out


def read_by_dots_only(fgraph, var) -> bool:
    """Whether every use of ``var`` in ``fgraph`` is as the left matrix of a ``Dot``."""
    clients = fgraph.clients.get(var, [])
    return bool(clients) and all(isinstance(getattr(node, "op", None), Dot) and node.inputs[0] is var
                                 and node.inputs[1] is not var for node, _ in clients)


def _transposed(var):
    """``x`` when ``var`` is ``x.T`` of a matrix ``x``, else None."""
    owner = var.owner
    if owner is not None and isinstance(owner.op, DimShuffle) and tuple(owner.op.new_order) == (1, 0):
        return owner.inputs[0]
    return None


@node_rewriter([Dot])
def dot_of_transposed(fgraph, node):
    """``dot(A.T, B)`` -> ``dot(B.T, A).T`` (the same values): with ``A`` feature-major
    storage XLA reads it in its own order in both directions (see the module's notes)."""
    left, right = node.inputs
    inner = _transposed(left)
    if inner is None or inner.owner is None or not isinstance(inner.owner.op, FeatureMajor):
        return None
    return _as_output(node, pt.dot(right.T, inner).T)


@node_rewriter([ARange])
def arange_in_its_dtype(fgraph, node):
    """``arange(start, stop, step)`` with bounds of a narrower dtype than its own -> the bounds
    cast to its dtype. PyTensor 2.38 renders it in JAX as ``jnp.arange`` of the bounds as they
    are: an ``int8`` constant start against a row count past 127 overflowed under NumPy 2
    (``OverflowError``; PyMC's Categorical, 128 rows or more in a process)."""
    dtype = node.op.dtype
    if all(i.type.dtype == dtype for i in node.inputs):
        return None
    # a constant stays a constant (PyTensor 2's JAX arange wants its bounds concrete)
    bounds = [i if i.type.dtype == dtype else
              pt.constant(np.asarray(i.data, dtype=dtype)) if isinstance(i, TensorConstant) else pt.cast(i, dtype)
              for i in node.inputs]
    return _as_output(node, node.op(*bounds))


def rewrite_for_xla(fgraph):
    """Rewrite ``fgraph`` in place for XLA on the CPU; returns it."""
    in2out(arange_in_its_dtype, name="arange_in_its_dtype").rewrite(fgraph)
    in2out(dot_of_transposed, name="dot_of_transposed").rewrite(fgraph)
    in2out(bounded_link_checks, name="bounded_link_checks").rewrite(fgraph)
    in2out(switch_of_log_sigmoids, name="switch_of_log_sigmoids").rewrite(fgraph)
    in2out(softplus_by_abs, name="softplus_by_abs").rewrite(fgraph)
    in2out(sum_of_guarded, name="sum_of_guarded").rewrite(fgraph)
    in2out(sum_of_switch_less_log, name="sum_of_switch_less_log").rewrite(fgraph)
    in2out(sum_of_log_terms, name="sum_of_log_terms").rewrite(fgraph)
    return fgraph


def prepare_for_xla(fgraph):
    """``fgraph`` rewritten in place as :func:`render_for_xla` renders it (JAX mode's
    rewrites but its elemwise fusion, then :func:`rewrite_for_xla`); returns it."""
    from pytensor.compile.mode import get_mode

    # without PyTensor's elemwise fusion: it folds the switch and softplus into one
    # Composite, where these rewrites find nothing (PyTensor 3.0.7); XLA fuses anyway
    get_mode("JAX").excluding("fusion").optimizer.rewrite(fgraph)
    return rewrite_for_xla(fgraph)


def render_for_xla(fgraph):
    """``fgraph`` (rewritten in place by :func:`prepare_for_xla`) as a JAX function:
    PyTensor's JAX rendering (imports JAX)."""
    from pytensor.link.jax.dispatch import jax_funcify

    register_feature_major()
    return jax_funcify(prepare_for_xla(fgraph))
