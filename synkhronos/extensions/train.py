"""make_train_function: a data-parallel train step from a loss and an update rule."""

from __future__ import annotations

import numpy as np
from pytensor.graph.basic import Variable

import synkhronos as synk

from .updates import RULES, SplitUpdates, resolve_rule

__all__ = ["TrainStep", "make_train_function"]


class TrainStep:
    """One data-parallel training step, callable like a function of the inputs.

    A call runs, in every process: the gradient function on its rows of the
    inputs, one ``all_reduce(op="sum")`` of the flat gradient vector, and the
    update function, which applies the rule to each process's own copy of the
    parameters. Build it with :func:`make_train_function`.

    Attributes:
        grad_function: the :class:`synkhronos.Function` computing the loss and
            the flat gradient.
        update_function: the :class:`synkhronos.Function` (no inputs) applying
            the rule.
        split: the :class:`~synkhronos.extensions.updates.SplitUpdates` used.
        rule: the name of the update rule.
    """

    def __init__(self, split: SplitUpdates, grad_function, update_function, rule: str):
        self.split = split
        self.grad_function = grad_function
        self.update_function = update_function
        self.rule = rule

    @property
    def params(self) -> list:
        """The trained shared variables."""
        return list(self.split.params)

    @property
    def state(self) -> list:
        """The update rule's own shared variables (velocities, moments, step count)."""
        return list(self.split.state)

    @property
    def grad_shared(self):
        """The flat gradient vector all-reduced at every step."""
        return self.split.grad_shared

    def __call__(self, *args, batch=None, batch_s=None, num_slices=1, **kwargs) -> float:
        """Take one step on a batch.

        Args:
            *args: the inputs, in order, as for the gradient function (numpy
                arrays or :func:`synkhronos.data`).
            **kwargs: inputs by name.
            batch: rows of the scattered inputs to train on (int, slice or
                index list), selected before scattering.
            batch_s: rows of the sliceable shared variables, per process.
            num_slices: each process accumulates its gradient over this many
                slices of its rows (less memory, same result).

        Returns:
            The loss averaged over the batch (weighted by rows), as a float.

        Raises:
            Whatever the underlying call raises: bad inputs (TypeError,
            ValueError, IndexError) or a worker's error.
        """
        loss = self.grad_function(*args, batch=batch, batch_s=batch_s, num_slices=num_slices, **kwargs)
        synk.all_reduce(self.split.grad_shared, op="sum")
        self.update_function()
        return float(np.asarray(loss))

    def sync(self) -> None:
        """Copy the master's parameters and rule state to every process.

        Needed only after changing them in the master alone (for example with
        ``set_value`` or :meth:`as_pytensor`); the train step itself keeps
        every replica identical.
        """
        synk.broadcast(self.params + self.state)

    def as_pytensor(self, *args, **kwargs) -> float:
        """Take the same step in the master only, with plain PyTensor, on the whole batch.

        Only the master's copies change; call :meth:`sync` before the next
        distributed step.

        Returns:
            The loss on the batch, as a float.
        """
        loss = self.grad_function.as_pytensor(*args, **kwargs)
        self.update_function.as_pytensor()
        return float(np.asarray(loss))

    def __repr__(self) -> str:
        return f"<TrainStep {self.rule}: {len(self.split.params)} params>"


def make_train_function(loss, params, inputs, update_rule, bcast_inputs=None, sliceable_shareds=None,
                        givens=None, weight=None, function_kwargs=None, **hyperparameters) -> TrainStep:
    """Build a data-parallel train step: gradients, one all-reduce, the update.

    Call it after :func:`synkhronos.fork`. The functions are distributed on the
    first call (or by :func:`synkhronos.distribute`).

    Args:
        loss: scalar PyTensor expression, the mean of a per-row loss over the
            rows of the inputs (so the result is the mean over the batch).
        params: the shared variables to train.
        inputs: the PyTensor input variables, in call order (scattered along
            axis 0 unless listed in ``bcast_inputs``).
        update_rule: a rule of :mod:`synkhronos.extensions.updates`, by
            function or by name (``"adam"``).
        bcast_inputs: inputs every process gets whole.
        sliceable_shareds: shared variables holding data rows, selected per
            call with ``batch_s``.
        givens: as for :func:`synkhronos.function`.
        weight: symbolic number of rows of each process's loss. Default: the
            first scattered input's length (or the first sliceable shared
            variable's), which makes uneven splits exact.
        function_kwargs: keywords for both :func:`synkhronos.function` calls
            (``mode``, ...).
        **hyperparameters: for the rule (``learning_rate=0.01``, ...).

    Returns:
        A :class:`TrainStep`.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError, ValueError: an unknown rule or bad arguments, named in the message.
    """
    name = resolve_rule(update_rule)
    if not isinstance(inputs, (list, tuple)) or not all(isinstance(v, Variable) for v in inputs):
        raise TypeError(f"inputs must be a list of PyTensor variables, got {inputs!r}")
    inputs = list(inputs)
    bcast = list(bcast_inputs or [])
    if weight is None:
        scattered = [v for i, v in enumerate(inputs)
                     if not any(b is v or (isinstance(b, int) and b == i) for b in bcast)]
        rows_of = scattered[:1] or list(sliceable_shareds or [])[:1]
        if rows_of:
            weight = rows_of[0].shape[0]
    split = RULES[name](loss, params, weight=weight, **hyperparameters)
    kw = dict(function_kwargs or {})
    grad_function = synk.function(inputs, loss, bcast_inputs=bcast or None, updates=split.grad_updates,
                                  givens=givens, sliceable_shareds=sliceable_shareds,
                                  name=f"{name}_gradient", **kw)
    update_function = synk.function([], None, updates=split.param_updates, name=f"{name}_update", **kw)
    return TrainStep(split, grad_function, update_function, name)
