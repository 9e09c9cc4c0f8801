"""A data-parallel PyMC model's share in JAX mode: its value and gradient by JAX's autodiff
(:class:`JaxValueAndGrad`, PyTensor's symbolic gradient where that is not finite), and the
gradient as PyMC takes it (:func:`pregrad_grads`). Used by :mod:`synkhronos.pymc`."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytensor
import pytensor.tensor as pt
from pymc.pytensorf import rewrite_pregrad
from pytensor.graph.basic import Apply
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.op import Op
from pytensor.graph.replace import clone_replace
from pytensor.graph.rewriting.basic import node_rewriter

from ..devices.jax_state import HOST_REWRITES
from .xla_rewrites import feature_major_as_reshape, render_for_xla

__all__ = ["JaxValueAndGrad", "pregrad_grads"]


def pregrad_grads(cost, wrt) -> list:
    """The gradient of ``cost`` with respect to the list ``wrt`` as PyMC takes it
    (``Model.dlogp``): of the cost after PyMC's pre-gradient rewrites, which stabilise it
    (``log1pexp``, ``log(sigmoid)``...). Taken on the graph as written, the gradient of a
    logistic regression's Bernoulli was NaN where PyMC's is finite (``logit_p`` of -800)."""
    return cast(list, pytensor.grad(rewrite_pregrad(cost), wrt, disconnected_inputs="ignore"))


class JaxValueAndGrad(Op):
    """A scalar graph's value and its gradient with respect to some of its inputs, by
    JAX's autodiff (``jax.value_and_grad`` of the graph rendered in JAX).

    Each process's share of a data-parallel model in JAX mode. XLA compiles the
    backward pass with the forward one: on the benchmark's logistic regression
    (100,000 rows, one process, an Intel Xeon) this took 3.65 ms where
    PyTensor's symbolic gradient rendered in JAX took 4.57 ms. The graph is
    first rewritten to forms XLA runs faster (:mod:`synkhronos._integrations.xla_rewrites`:
    PyMC's Bernoulli with ``logit_p`` and ``softplus``; 5.9 ms to 3.7 ms there).

    Args:
        inputs: the graph's inputs (root variables; shared variables too).
        output: the scalar to differentiate.
        wrt: positions in ``inputs`` of the variables of the gradient (floats).

    Its outputs are the value, then one gradient per ``wrt``, each of its
    variable's type. The Op holds the graph itself (it pickles to the workers
    with the function) and renders it in JAX in each process. Outside JAX
    mode, ``perform`` runs the same JAX function, except in ``host_mode``
    (the master's share inside an XLA callback, where JAX cannot run), whose
    rewrites expand the Op into the value and its symbolic gradient.
    """

    def __init__(self, inputs, output, wrt):
        self.inner_inputs = [v.type() for v in inputs]
        self.inner_output = clone_replace(output, dict(zip(inputs, self.inner_inputs)))
        self.wrt = tuple(wrt)
        self._jitted = None
        super().__init__()
        _register_value_and_grad()

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_jitted"}

    def __setstate__(self, state):  # in a worker: teach its JAX backend the Op before it compiles
        self.__dict__.update(state, _jitted=None)
        _register_value_and_grad()

    def make_node(self, *inputs):
        if len(inputs) != len(self.inner_inputs):
            raise ValueError(f"{self}: {len(self.inner_inputs)} inputs expected, got {len(inputs)}")
        filtered = [t.type.filter_variable(v) for t, v in zip(self.inner_inputs, inputs)]
        outputs = [self.inner_output.type()] + [self.inner_inputs[i].type() for i in self.wrt]
        return Apply(self, filtered, outputs)

    def jax_function(self):
        """The JAX function ``(*inputs) -> (value, *gradients)`` (imports JAX)."""
        import jax

        inner = render_for_xla(FunctionGraph(self.inner_inputs, [self.inner_output], clone=True))
        wrt = self.wrt
        # PyTensor's symbolic gradient (PyMC's own), for the points where autodiff is not finite
        symbolic = render_for_xla(FunctionGraph(self.inner_inputs, self._symbolic_grads(), clone=True)) \
            if wrt else inner  # (without wrt: never called)

        def value_and_grads(*args):
            def value(*chosen):
                full = list(args)
                for i, v in zip(wrt, chosen):
                    full[i] = v
                return inner(*full)[0]

            if not wrt:
                return (value(),)
            val, grads = jax.value_and_grad(value, argnums=tuple(range(len(wrt))))(*[args[i] for i in wrt])
            # autodiff through a switch differentiates the branch not taken too: 0 * inf is NaN
            # there (a normal log-cdf's tail in ExGaussian, truncation, censoring, OrderedProbit)
            # where the symbolic gradient is finite; XLA's conditional runs that one only then
            finite = jax.numpy.all(jax.numpy.stack([jax.numpy.all(jax.numpy.isfinite(g)) for g in grads]))

            def exact():
                return tuple(jax.numpy.asarray(s, g.dtype).reshape(g.shape)
                             for s, g in zip(symbolic(*args), grads))

            return (val, *jax.lax.cond(finite, lambda: tuple(grads), exact))

        return value_and_grads

    def _symbolic_grads(self) -> list:
        """The inner graph's symbolic gradient with respect to ``wrt`` (PyTensor's, as PyMC's own)."""
        wrt = [self.inner_inputs[i] for i in self.wrt]
        return pregrad_grads(self.inner_output, wrt)

    def perform(self, node, inputs, outputs):
        if self._jitted is None:
            import jax

            self._jitted = jax.jit(self.jax_function())
        for out, value, var in zip(outputs, self._jitted(*inputs), node.outputs):
            out[0] = np.asarray(value, dtype=var.type.dtype)

    def __str__(self):
        return f"JaxValueAndGrad{{{self.inner_output.name or 'value'}}}"


def _register_value_and_grad() -> None:
    from pytensor.compile import optdb
    from pytensor.graph.rewriting.basic import in2out
    from pytensor.link.jax.dispatch import jax_funcify

    if JaxValueAndGrad not in jax_funcify.registry:
        jax_funcify.register(JaxValueAndGrad)(lambda op, node=None, **kwargs: op.jax_function())
    if "synk_value_and_grad_without_jax" not in optdb:  # before the rewrites of the expanded graph
        optdb.register("synk_value_and_grad_without_jax", in2out(_value_and_grad_without_jax),
                       HOST_REWRITES, position=0.1)
        optdb.register("synk_feature_major_as_reshape", in2out(feature_major_as_reshape),
                       HOST_REWRITES, position=0.2)


@node_rewriter([JaxValueAndGrad])
def _value_and_grad_without_jax(fgraph, node):
    """:class:`JaxValueAndGrad` as PyTensor's own graph: the value and its symbolic gradient
    (partial derivatives: taken on the inner graph, whose inputs are independent). Only in
    ``host_mode``: a share inside an XLA callback, where JAX cannot run."""
    op = node.op
    wrt = [op.inner_inputs[i] for i in op.wrt]
    grads = pregrad_grads(op.inner_output, wrt) if wrt else []
    outs = clone_replace([op.inner_output, *grads], dict(zip(op.inner_inputs, node.inputs)))
    return [o if o.type.dtype == v.type.dtype else pt.cast(o, v.type.dtype) for o, v in zip(outs, node.outputs)]
