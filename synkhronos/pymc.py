"""PyMC models data-parallel: the observed log-likelihood summed across the fork (extra ``[pymc]``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.replace import graph_replace
from pytensor.tensor.variable import TensorConstant, TensorVariable

import synkhronos as synk
from synkhronos._batching import split as split_evenly
from synkhronos._integrations.graph_op import register_jax, register_numba
from synkhronos._integrations.row_split import (Coupling, batched_op_of_rows, hoist_data_only,
                                                masks_as_positions, split_rows)
from synkhronos._procs.cores import available_cores
from synkhronos._procs.xla_flags import xla_flags
from synkhronos._integrations.xla_rewrites import (FeatureMajor, feature_major, prepare_for_xla,
                                                   read_by_dots_only)

try:
    import pymc as pm
    from pymc.model.fgraph import clone_model
    from pymc.pytensorf import rewrite_pregrad
except ImportError as err:  # pragma: no cover - the extra is missing
    raise ImportError("synkhronos.pymc needs PyMC: pip install 'synkhronos[pymc]'") from err

from synkhronos._integrations.value_and_grad import JaxValueAndGrad, pregrad_grads  # noqa: E402  (needs PyMC)

try:
    from pytensor.graph.traversal import graph_inputs
except ImportError:  # pragma: no cover - PyTensor 2
    from pytensor.graph.basic import graph_inputs  # type: ignore[no-redef, unused-ignore]  # (the other PyTensor's)

__all__ = ["data_parallel", "default_mode", "DataParallelModel", "JaxValueAndGrad", "SAMPLERS"]

#: ``pm.sample(nuts_sampler=...)`` values tested on a data-parallel model (``cores=1``):
#: numpyro through the Op's JAX rendering, nutpie through Numba (the Op in object mode).
#: "blackjax" goes the numpyro way, but fails with PyMC 6.4 and blackjax 1.7 on any model.
SAMPLERS = ("pymc", "numpyro", "nutpie")
#: Relative difference under which a split log-likelihood counts as equal to the whole.
COUPLING_RTOL = 1e-8


#: Rows each process's block of per-row data is rounded up to, in JAX mode: every block then
#: starts on a 64-byte boundary whatever the dtype, and XLA reads it where it lies (JAX copies
#: an input that is not so aligned at every call: at 200,001 rows, 2 processes, the Poisson
#: share took 7.2 ms against 3.9 ms at 200,000, AMD EPYC, 2026-11-27).
BLOCK_ROWS = 64


@dataclasses.dataclass
class _Split:
    """What a data-parallel model computes across the fork, and from what.

    The layout of the per-row data in shared memory has one owner, :meth:`layout`, and one
    validity rule: it is a function of the values, the row count and the node's process
    count, written at the split and again, for every copy, after any ``pm.set_data`` of
    per-row data (:func:`_follow_data`)."""

    term: Variable | None  # the summed observed log-likelihood, a graph of the model's value variables
    op: object            # the SynkOp
    rows: list            # (model data variable or constant, its synk.data, the value it was copied from)
    n_rows: int
    observed: list        # names of the observed variables it replaces
    checker: _Checker | None = None  # the numerical check of the split, run again after pm.set_data
    derived: list = dataclasses.field(default_factory=list)  # synk.data of per-row parts computed once
    derive: Callable | None = None  # computes them from the per-row data (rows' order), after every change
    feature_major: frozenset = frozenset()  # positions in rows whose copy is laid out feature-major
    padded: bool = False    # each process's rows padded to a block of BLOCK_ROWS rows
    mask: synk.Data | None = None  # synk.data of the row mask of the padded blocks
    row_axes: tuple = ()    # the row axis of each of rows' data in its own layout (its copy holds them first)

    def bounds(self, n: int) -> list:
        """Each process's ``(lo, hi)`` of a call's ``n`` scattered rows: ``batching.split`` over
        the node's processes in rank order, as every call splits them."""
        size = synk.world().local_size
        return [split_evenly(n, size, r) for r in range(size)]

    def block(self, n_rows: int) -> int:
        """Rows of each process's padded block for ``n_rows`` rows of data."""
        most = -(-n_rows // synk.world().local_size)
        return -(-most // BLOCK_ROWS) * BLOCK_ROWS

    def layout(self, value, feature_major_rows: bool = False) -> np.ndarray:
        """Per-row ``value`` (rows along axis 0) as its shared-memory copy holds it. Padded
        (where :attr:`padded`): process ``r``'s rows, then copies of one of them (of
        row 0 where it has none) up to :meth:`block` rows; feature-major where asked."""
        value = np.asarray(value)
        n = len(value)
        if self.padded and n:
            rows, b = self.bounds(n), self.block(n)
            padded = np.empty((b * len(rows),) + value.shape[1:], dtype=value.dtype)
            for r, (lo, hi) in enumerate(rows):
                padded[r * b:r * b + hi - lo] = value[lo:hi]
                padded[r * b + hi - lo:(r + 1) * b] = value[lo if hi > lo else 0]
            value = padded
        if not feature_major_rows:
            return value
        n = len(value)
        return feature_major(value, self.bounds(n))

    def stored(self, i: int, value) -> np.ndarray:
        """The value of ``rows[i]`` as its shared-memory copy holds it (its rows first)."""
        return self.layout(self.rows_first(i, value), i in self.feature_major)

    def rows_first(self, i: int, value) -> np.ndarray:
        """The value of ``rows[i]`` with its rows along axis 0."""
        return _rows_first(value, self.row_axes[i] if i < len(self.row_axes) else 0)

    def row_count(self, i: int, value) -> int:
        """The number of rows of a value of ``rows[i]``."""
        return int(np.shape(value)[self.row_axes[i] if i < len(self.row_axes) else 0])

    def row_mask(self, n_rows: int) -> np.ndarray:
        """True at each process's own rows of the padded blocks, False at the copies."""
        rows = self.bounds(n_rows)
        b = self.block(n_rows) if n_rows else 0
        mask = np.zeros(b * len(rows), dtype=bool)
        for r, (lo, hi) in enumerate(rows):
            mask[r * b:r * b + hi - lo] = True
        return mask


if TYPE_CHECKING:  # what DataParallelModel is mixed into (object at run time)
    from pymc import Model as _PyMCModel
else:
    _PyMCModel = object


class DataParallelModel(_PyMCModel):
    """Mixed into a clone of a PyMC model by :func:`data_parallel`: its log-density
    takes the observed variables' term from the fork; all else is PyMC's."""

    synk_split: _Split

    def logp(self, vars=None, jacobian=True, sum=True):  # noqa: A002 - PyMC's signature
        if "pytensor.link.jax.dispatch" in sys.modules:  # a JAX sampler is compiling this
            register_jax()
        varlist = (self.free_RVs + self.observed_RVs + self.potentials if vars is None
                   else list(vars) if isinstance(vars, (list, tuple)) else [vars])
        observed = [v for v in varlist if any(self.values_to_rvs.get(v, v) is o for o in self.observed_RVs)]
        if not sum or len(observed) != len(self.observed_RVs):
            # one variable's terms, or elementwise terms: PyMC's own, on the master's copy of the data
            return super().logp(vars=vars, jacobian=jacobian, sum=sum)
        rest = [v for v in varlist if all(v is not o for o in observed)]
        total = cast(Variable, self.synk_split.term)  # (made before the model is returned)
        if rest:
            total = super().logp(vars=rest, jacobian=jacobian, sum=True) + total
        total.name = ("__logp" if jacobian else "__logp_nojac") + (f"_{self.name}" if self.name else "")
        return total


def default_mode():
    """The PyTensor mode of each process's share: JAX where it is installed, else
    PyTensor's default.

    Measured on the logistic regression of ``bench/pymc_bench.py`` (2 processes, 200,000
    rows, value and gradient): JAX 3.9 ms, Numba 5.0 ms, C 5.0 ms (docs/pymc.rst)."""
    return "JAX" if importlib.util.find_spec("jax") is not None else None


def data_parallel(model, rows=None, *, mode="auto", check=True):
    """A copy of a PyMC model whose observed log-likelihood is computed across the fork.

    Call after :func:`synkhronos.fork`. The per-row data go into shared memory
    once; every evaluation of the model's log-density (and its gradient, from
    the same call) sums the observed variables' log-likelihood over every
    process's rows. Each process's share is PyMC's own log-density of the
    observed variables (``model.logp``: value variables, transforms, parameter
    checks as -inf), on its rows. Priors, Jacobians and potentials are
    computed once, in the master. ``pm.sample`` (``nuts_sampler`` "pymc",
    "numpyro" or "nutpie", ``cores=1``), ``pm.find_MAP``, ``pm.fit`` and
    ``pm.sample_posterior_predictive`` take the copy as they take the model.

    Args:
        model: a ``pm.Model`` with observed variables.
        rows: names of the data containers (``pm.Data``) that hold one entry
            per row along their first axis. Default: found from the observed
            variables: their data, and every data container or constant in
            their log-likelihood with as many rows (along their first axis, or,
            where that does not split, along another: data stored transposed).
        mode: the PyTensor mode each process compiles its share with; ``"auto"``
            (default) is :func:`default_mode`: JAX where it is installed (one XLA
            thread per process) and renders every op of the share, else PyTensor's
            default.
        check: prove that each observed term is a sum over rows: from the graph
            (nothing reduces, slices or reshapes along the rows, nothing depends on
            their number), and by value and gradient on a split of the data, again
            after every ``pm.set_data`` of per-row data. ``False`` skips both.

    Returns:
        The data-parallel copy of ``model`` (a ``pm.Model``).

    Raises:
        TypeError: ``model`` is not a PyMC model.
        ValueError: no observed variable; per-row data of different row
            counts; a free variable with one entry per row (a per-row latent
            variable); missing values in the observed data; no continuous free
            variable; an observed term that couples rows. Each names the
            variable and the reason.
    """
    if not isinstance(model, pm.Model):
        raise TypeError(f"data_parallel takes a pm.Model, got {model!r}")
    if not model.observed_RVs:
        raise ValueError(f"model {model.name or '(unnamed)'} has no observed variables: there is no "
                         "per-row data to split across processes")
    _check_no_imputation(model)
    new = _clone(model)
    terms = new.logp(vars=new.observed_RVs, sum=False, jacobian=False)
    values = _values_of_free(new, terms)
    (local_terms, n_rows, row_leaves, axes, row_in, masked), leaves = _split_or_positions(new, terms, values, rows,
                                                                                        check)
    glob = [leaf for leaf in leaves if leaf not in row_leaves and isinstance(leaf, SharedVariable)]
    glob_in = [leaf.type(name=leaf.name) for leaf in glob]
    value_in = [v.type(name=v.name) for v in values]
    local_terms = graph_replace(local_terms, dict(zip(glob + values, glob_in + value_in)), strict=False)
    checker = _Checker(new, local_terms, row_in + glob_in + value_in, row_leaves, axes, glob, values) \
        if check else None
    if checker is not None:
        checker.check(n_rows)
    split = _distribute(new, local_terms, row_leaves, axes, glob, values, row_in, glob_in, value_in, n_rows, mode,
                        check, masked)
    split.checker = checker
    new.__class__ = type(f"DataParallel{type(new).__name__}", (DataParallelModel, type(new)), {})
    new.synk_split = split
    return new


def _check_no_imputation(model) -> None:
    """PyMC imputes an observed variable's missing values with a free variable, one entry per
    missing row: a latent per row, which the split cannot follow."""
    for rv in model.free_RVs:
        if rv.name.endswith("_unobserved") and rv.name[:-len("_unobserved")] + "_observed" in model.named_vars:
            name = rv.name[:-len("_unobserved")]
            raise ValueError(
                f"observed variable {name!r} has missing values (NaN or masked): PyMC imputes them with "
                f"free variable {rv.name!r}, one entry per missing row, which synkhronos.pymc cannot split "
                "across processes; drop the rows with missing values, or model them without data_parallel")


def _clone(model):
    """A clone of ``model`` whose variables keep the model's order (the order of the value
    variables is the order of every flat vector that samplers and optimisers use).

    PyMC's clone refuses initial values and data dims without a name (``None``): both are
    set aside for the clone and given back to each model."""
    initvals = dict(model.rvs_to_initial_values)
    symbolic = [rv.name for rv, v in initvals.items() if isinstance(v, Variable)]
    if symbolic:
        raise ValueError(f"free variable {symbolic[0]!r} has a symbolic initval: synkhronos.pymc clones the "
                         "model, which PyMC cannot do with symbolic initial values; give a number or array")
    unnamed = {name: ds for name, ds in model.named_vars_to_dims.items() if any(d is None for d in ds)}
    try:
        model.rvs_to_initial_values.update(dict.fromkeys(initvals))
        for name in unnamed:
            del model.named_vars_to_dims[name]
        new = clone_model(model)
    finally:
        model.rvs_to_initial_values.update(initvals)
        model.named_vars_to_dims.update(unnamed)
    new.named_vars_to_dims.update(unnamed)
    for rv, value in initvals.items():
        if value is not None:
            new.rvs_to_initial_values[new[rv.name]] = value
    for attr in ("free_RVs", "observed_RVs", "deterministics", "potentials", "data_vars"):
        mine, theirs = getattr(new, attr), getattr(model, attr)
        order = {v.name: i for i, v in enumerate(theirs)}
        if getattr(mine, "parent", None) is None and len(mine) == len(theirs) \
                and all(v.name in order for v in mine):
            list.__setitem__(mine, slice(None), sorted(mine, key=lambda v: order[v.name]))
    return new


def _values_of_free(model, terms) -> list:
    """The value variables of the free variables the observed terms read, in the model's order;
    at least one continuous."""
    inputs = set(graph_inputs(terms))
    values = [model.rvs_to_values[rv] for rv in model.free_RVs if model.rvs_to_values[rv] in inputs]
    if values and not any(v.type.dtype.startswith("float") for v in values):
        raise ValueError(
            f"the observed terms of model {model.name or '(unnamed)'} depend on discrete free variables only "
            f"({[v.name for v in values]}): nothing continuous to differentiate, and synkhronos.pymc splits "
            "the log-density and its gradient; sample this model without data_parallel")
    return values


def _split_by_rows(model, terms, values, leaves, rows, check) -> tuple:
    """``(each observed term on a process's rows, n_rows, the per-row data, the row axis of each,
    a variable of a process's rows of each, rows first, whether a term's rows are those a boolean
    mask kept)``.

    The rows are an axis of the observed data, axis 0 first, then each other one; the per-row
    data are first those with as many rows along axis 0 (the layout the docs name), then also
    those with as many along another axis (data stored transposed, ``X.T``; the first such
    axis). The first of these choices whose terms :func:`split_rows` proves a sum over the rows
    is taken: any such choice splits to the whole, whatever the data mean. None: the first
    choice's refusal (with the others' reasons)."""
    failures: list = []
    for n_rows in _row_counts(model, rows):
        tried = set()
        for any_axis in (False, True):
            row_leaves, axes = _row_leaves(model, leaves, rows, n_rows, any_axis)
            if not row_leaves or (tuple(row_leaves), tuple(axes)) in tried:
                continue
            tried.add((tuple(row_leaves), tuple(axes)))
            try:
                _check_no_row_latents(model, values, n_rows)
                row_in = [_row_type(leaf, axis) for leaf, axis in zip(row_leaves, axes)]
                for leaf, var in zip(row_leaves, row_in):
                    var.name = _leaf_name(model, leaf)
                replace = {leaf: _rows_back(var, axis) for leaf, var, axis in zip(row_leaves, row_in, axes)}
                masked: list = []
                local = _split_terms(model, terms, replace, n_rows, check, dict(zip(row_leaves, axes)), masked)
                _check_empty_shares(model, local, row_in, n_rows, any(masked), row_leaves)
                return local, n_rows, row_leaves, axes, row_in, any(masked)
            except ValueError as err:
                failures.append((n_rows, any_axis, str(err)))
    if not failures:
        raise ValueError("the observed terms read no data with as many rows as the observed data: there is "
                         "nothing to split across processes")
    n_rows, _, why = failures[0]
    others = [f"with {n} rows{' (data along other axes too)' if a else ''}: {w}"
              for n, a, w in failures[1:] if w != why]
    raise ValueError(why + ("" if not others else " (also tried " + "; ".join(others) + ")")) from None


def _split_or_positions(model, terms, values, rows, check) -> tuple:
    """``(_split_by_rows's split, the data the terms read)``: of the terms as PyMC wrote them or,
    where they do not split, with every NumPy boolean mask that indexes in them taken as the
    positions it keeps (:func:`masks_as_positions`: observed data selected in NumPy against
    covariates of all the rows selected in the model, ``(X @ b)[mask]``). There each process
    computes the covariates of all the rows: a warning says so, and how to split them too."""
    leaves = _data_leaves(terms)
    try:
        return _split_by_rows(model, terms, values, leaves, rows, check), leaves
    except ValueError as err:
        indexed = masks_as_positions(terms)
        if indexed is None:
            raise
        leaves = _data_leaves(indexed)
        try:
            done = _split_by_rows(model, indexed, values, leaves, rows, check)
        except ValueError:
            raise err from None
    warnings.warn(f"the observed data of {[rv.name for rv in model.observed_RVs]} were selected by a NumPy boolean "
                  "mask and their covariates in the model (such as (X @ b)[mask]): each process computes the "
                  "covariates of all the rows and takes its rows' positions of them, so only the observed terms "
                  "are split; select the covariates in NumPy too (X[mask] @ b) for a split of all the work",
                  UserWarning, stacklevel=3)
    return done, leaves


def _check_empty_shares(model, local, row_in, n_rows, masked, row_leaves) -> None:
    """A process may hold none of the rows where a boolean mask keeps them (or where the data
    are one row of numbers), and PyTensor's Python implementation of a batched op fails on a
    batch of none (NumPy's ``vectorize`` of zero size; FAST_COMPILE, and PyTensor 2's default
    backend where a rewrite does not remove it): refused there. (Data containers of one row
    are split as before: ``pm.set_data`` may give them more.)"""
    if not (masked or (n_rows == 1 and not any(isinstance(v, SharedVariable) for v in row_leaves))):
        return
    for rv, term in zip(model.observed_RVs, local):
        if (op := batched_op_of_rows([term], row_in)) is not None:
            raise ValueError(f"observed variable {rv.name!r}: a process may hold none of its rows (they are "
                             f"{'rows a boolean mask keeps' if masked else 'one row'}), and PyTensor's batched "
                             f"op {op} fails on none (NumPy's vectorize of zero size); " +
                             ("give the rows selected in NumPy" if masked else "use the model alone"))


def _rows_back(var, axis):
    """A process's rows of a per-row datum (rows first) in the datum's own layout (rows at ``axis``)."""
    if axis == 0:
        return var
    order = [0 if j == axis else j + 1 if j < axis else j for j in range(var.type.ndim)]
    return var.dimshuffle(order)


def _split_terms(model, terms, replace, n_rows, check, axes, masked) -> list:
    """Each observed term on a process's rows (:func:`synkhronos._integrations.row_split.split_rows`), with
    PyMC's rewrite of parameter checks (-inf where a parameter is out of its support)."""
    guard = _guard(model)
    out = []
    for rv, term in zip(model.observed_RVs, terms):
        try:
            out.append(split_rows([term], replace, n_rows, guard, axes=axes, masked=masked)[0])
        except Coupling as err:
            if check:
                raise ValueError(_coupling(rv, str(err))) from None
            out.append(split_rows([term], replace, n_rows, guard, strict=False, axes=axes, masked=masked)[0])
    return out


def _guard(model):
    """PyMC's own rewrite of a parameter check, as ``pm.compile`` applies it: ``switch(cond,
    logp, -inf)`` (or the check removed where the model says ``check_bounds=False``)."""
    from pymc.logprob.utils import (CheckParameterValue, local_check_parameter_to_ninf_switch,
                                    local_remove_check_parameter)

    rewrite = local_check_parameter_to_ninf_switch if model.check_bounds else local_remove_check_parameter

    def guard(node, inputs):
        if not isinstance(node.op, CheckParameterValue):
            return None
        new = node.op.make_node(*inputs)
        done = rewrite.transform(None, new)
        return done[0] if done else new.outputs[0]

    return guard


def _data_leaves(terms) -> list:
    """The data in the observed terms: shared tensors and constants of at least one axis."""
    out = []
    for leaf in graph_inputs(terms):
        if isinstance(leaf, (SharedVariable, TensorConstant)) and isinstance(leaf.type, pt.TensorType) \
                and leaf.type.ndim >= 1 and leaf not in out:
            out.append(leaf)
    return out


def _row_type(leaf, axis=0):
    """A variable for a process's rows of ``leaf`` (its ``axis`` first): any number of rows."""
    rest = [s for j, s in enumerate(leaf.type.shape) if j != axis]
    return pt.TensorType(leaf.type.dtype, shape=(None, *rest))()


def _rows_first(value, axis) -> np.ndarray:
    """A per-row datum's value with its rows (``axis``) first."""
    return np.moveaxis(np.asarray(value), axis, 0) if axis else np.asarray(value)


def _value(leaf) -> np.ndarray:
    return leaf.get_value(borrow=True) if isinstance(leaf, SharedVariable) else leaf.data


def _leaf_name(model, leaf) -> str:
    if leaf.name:
        return leaf.name
    for rv in model.observed_RVs:
        if model.rvs_to_values[rv] is leaf:
            return f"{rv.name} (observed data)"
    return f"constant of shape {_value(leaf).shape}"


def _observed_shapes(model) -> dict:
    """``{observed variable's name: the shape of its data}``."""
    out = {}
    for rv in model.observed_RVs:
        value = model.rvs_to_values[rv]
        data = _value(value) if isinstance(value, (SharedVariable, TensorConstant)) else value.eval()
        if np.ndim(data) == 0:
            raise ValueError(f"observed data of {rv.name!r} is 0-d: it has no rows to split")
        out[rv.name] = tuple(int(n) for n in np.shape(data))
    return out


def _named_rows(model, rows) -> dict:
    """``{container: its number of rows}`` (its first axis) of the data containers ``rows`` names."""
    named: dict = {}
    if rows is None:
        return named
    for name in [rows] if isinstance(rows, str) or not isinstance(rows, (list, tuple)) else rows:
        var = model.named_vars.get(name) if isinstance(name, str) else None
        if var is None or not isinstance(var, SharedVariable):
            raise ValueError(f"rows: {name!r} is not a data container (pm.Data) of the model; "
                             f"its data containers are {[d.name for d in model.data_vars]}")
        if np.ndim(_value(var)) == 0:
            raise ValueError(f"rows: data container {name!r} is 0-d: it has no rows")
        named[var] = np.shape(_value(var))[0]
    return named


def _row_counts(model, rows) -> list:
    """The row counts the split may take, the first axis of the observed data first: each length
    of an axis of the first observed variable's data that every observed variable's data has
    along some axis (or, for observed data computed in the model, such as ``t[~censored]``
    from data containers, one of the data it reads: their first axes before the observed data's
    other axes), and every data container ``rows`` names along its first axis."""
    shapes, named = _observed_shapes(model), _named_rows(model, rows)
    lengths = {}
    for rv in model.observed_RVs:
        value = model.rvs_to_values[rv]
        found = list(shapes[rv.name])
        if not isinstance(value, (SharedVariable, TensorConstant)):  # (its data's first axes before its others)
            read = [np.shape(_value(leaf)) for leaf in graph_inputs([value])
                    if isinstance(leaf, (SharedVariable, TensorConstant)) and isinstance(leaf.type, pt.TensorType)]
            found = found[:1] + [int(s[0]) for s in read if s] + found[1:] + [int(n) for s in read for n in s[1:]]
        lengths[rv.name] = found
    first = next(iter(lengths.values()))
    counts = [n for n in dict.fromkeys(first)
              if all(n in found for found in lengths.values()) and all(c == n for c in named.values())]
    if not counts:
        listed = ", ".join([f"observed {k!r}: {v[0]}" + (f" (shape {v})" if len(v) > 1 else "") for k, v in shapes.items()]
                           + [f"data {v.name!r}: {n}" for v, n in named.items()])
        raise ValueError(f"the per-row data have different row counts ({listed}); expected one count "
                         "for all of them")
    return counts


def _row_leaves(model, leaves, rows, n_rows, any_axis) -> tuple[list, list]:
    """``(the per-row data, the row axis of each)``: the observed data and the containers ``rows``
    names, or by default every datum, with ``n_rows`` along its first axis, or (``any_axis``)
    along its first axis of that length."""
    observed = set(graph_inputs([model.rvs_to_values[rv] for rv in model.observed_RVs]))
    named = _named_rows(model, rows)
    out, axes = [], []
    for v in leaves:
        shape = np.shape(_value(v))
        if v in named:
            out.append(v)
            axes.append(0)
        elif (rows is None or v in observed) and (shape[0] == n_rows or (any_axis and n_rows in shape)):
            if n_rows == 1 and v not in observed and v.type.shape[shape.index(n_rows)] == 1:
                continue  # (a constant of length 1 broadcasts: sigma=1 as [1], a shape; not a row)
            out.append(v)
            axes.append(shape.index(n_rows))
    return out, axes


def _check_no_row_latents(model, values, n_rows) -> None:
    if n_rows <= 1:
        return
    shapes = model.eval_rv_shapes()
    for value in values:
        rv = model.values_to_rvs[value]
        shape = shapes.get(value.name, shapes.get(rv.name, ()))
        if len(shape) and shape[0] == n_rows:
            raise ValueError(
                f"free variable {rv.name!r} has one entry per row (shape {tuple(shape)}, {n_rows} rows): a "
                "per-row latent variable (an observation-level effect) would have to be split with the data, "
                "each process taking its rows' entries and giving back their gradient, and synkhronos.pymc "
                "splits data only (nor can it tell such a variable from one whose length merely equals the "
                "row count); marginalise it where the likelihood allows (y ~ Normal(a + u, s) with u ~ "
                "Normal(0, su) is y ~ Normal(a, sqrt(s**2 + su**2)); a Poisson with a Gamma effect is a "
                "NegativeBinomial), or sample this model without data_parallel")


class _Checker:
    """Each observed term's value and gradient on all rows against their sum over a split of
    the rows, at a random point: at the split, and after each ``pm.set_data`` of per-row data."""

    def __init__(self, model, local_terms, inputs, row_leaves, axes, glob, values):
        self.model, self.row_leaves, self.axes, self.glob, self.values = model, row_leaves, axes, glob, values
        wrt = [v for v in inputs[len(row_leaves) + len(glob):] if v.type.dtype.startswith("float")]
        sums = [t.sum() for t in local_terms]
        grads = [pregrad_grads(s, wrt) for s in sums]
        self.fn = pytensor.function(inputs, sums + [g for gs in grads for g in gs], mode="FAST_COMPILE",
                                    on_unused_input="ignore")
        self.n_wrt = len(wrt)

    def _point(self) -> list:
        ip = self.model.initial_point(random_seed=0)
        rng = np.random.default_rng(0)
        return [np.asarray(ip[v.name] + (rng.normal(0, 0.3, np.shape(ip[v.name]))
                                         if v.type.dtype.startswith("float") else 0), dtype=v.type.dtype)
                for v in self.values]

    def check(self, n_rows) -> None:
        if n_rows < 2:
            return
        rest = [_value(g) for g in self.glob] + self._point()
        whole_rows = [_rows_first(_value(v), a) for v, a in zip(self.row_leaves, self.axes)]
        n_terms = len(self.model.observed_RVs)
        evaluated = {}

        def run(lo, hi):
            if (lo, hi) not in evaluated:
                evaluated[lo, hi] = self.fn(*[r[lo:hi] for r in whole_rows], *rest)
            return evaluated[lo, hi]

        for cut in sorted({1, n_rows // 2}):
            for i, rv in enumerate(self.model.observed_RVs):
                self._compare(rv, n_rows, cut, run, i, n_terms)

    def _compare(self, rv, n_rows, cut, run, i, n_terms) -> None:
        where = [i] + list(range(n_terms + i * self.n_wrt, n_terms + (i + 1) * self.n_wrt))
        try:
            whole = [np.asarray(run(0, n_rows)[k], dtype=float) for k in where]
            parts = [sum(np.asarray(run(lo, hi)[k], dtype=float) for lo, hi in ((0, cut), (cut, n_rows)))
                     for k in where]
        except Exception as err:
            raise ValueError(_coupling(rv, f"split into rows [0:{cut}] and [{cut}:{n_rows}], it fails on "
                                           f"part of the rows ({err})")) from err
        for k, what, w, p in zip(where, ["value"] + ["gradient"] * self.n_wrt, whole, parts):
            rtol = _coupling_rtol(run(0, n_rows)[k])
            scale = max(float(np.max(np.abs(w), initial=0.0)), 1.0) if what == "gradient" else 0.0
            if not np.allclose(w, p, rtol=rtol, atol=rtol * scale, equal_nan=True):
                raise ValueError(_coupling(rv, f"split into rows [0:{cut}] and [{cut}:{n_rows}], its {what} "
                                               f"on all rows ({w!r}) differs from the sum over the parts ({p!r})"))


def _coupling_rtol(term) -> float:
    """:data:`COUPLING_RTOL` for a term computed in float64; scaled by the square root of its
    dtype's precision against float64's for a less precise one (float32: about 2e-4), whose
    sums over the parts round apart by more than 1e-8 (every floatX=float32 model was refused)."""
    dtype = np.asarray(term).dtype
    if dtype.kind != "f" or dtype.itemsize >= 8:
        return COUPLING_RTOL
    return COUPLING_RTOL * float(np.sqrt(np.finfo(dtype).eps / np.finfo(np.float64).eps))


def _coupling(rv, why) -> str:
    return (f"the log-likelihood of observed variable {rv.name!r} couples its rows: {why}. synkhronos.pymc "
            "sums each process's rows, so it takes observed terms that are a sum over rows (no row-wide "
            "means, no dependence across rows, no multivariate distribution over the row axis)")


def _distribute(model, local_terms, row_leaves, axes, glob, values, row_in, glob_in, rv_in, n_rows, mode,
                check, masked=False) -> _Split:
    local_terms, hoisted = hoist_data_only(local_terms, row_in)
    derive = pytensor.function(row_in, [g for _, g in hoisted], on_unused_input="ignore",
                               mode="FAST_COMPILE") if hoisted else None
    derived_in = [v for v, _ in hoisted]
    row_leaves, row_in = list(row_leaves), row_in + derived_in
    total = pt.add(*[t.sum() for t in local_terms])
    total.name = "observed_logp"
    continuous = [v for v in rv_in if v.type.dtype.startswith("float")]
    inputs = row_in + glob_in + rv_in
    inputs += [v for v in graph_inputs([total]) if isinstance(v, SharedVariable) and v not in inputs]
    fm, mask_in = set(), None
    mode, in_jax = _share_mode(mode, masked)
    if in_jax and continuous:
        # (padding needs each term's rows to be its data's: not so where a boolean mask kept some)
        total, row_in, inputs, fm, mask_in = _laid_out_for_xla(local_terms, total, row_in, inputs,
                                                               len(row_leaves), check and not masked)
    mode, jax_op = _jax_if_it_renders(mode, inputs, total, [inputs.index(v) for v in continuous])
    if mode == "JAX" and continuous:  # JAX's autodiff: value and gradient in one XLA program
        outs = jax_op(*inputs)
        total, grads = outs[0], outs[1:]
        total.name = "observed_logp"
    else:  # (a layout made for JAX that "auto" then left, its share unrenderable, computes
        # alike: FeatureMajor's perform reads the rows back, the mask leaves the copies out)
        # (PyMC's stabilising rewrites first, as its dlogp: a mode that rewrites little, such as
        # FAST_COMPILE, would otherwise take a logistic's log1pexp at -800 for -inf)
        total = rewrite_pregrad(total)
        total.name = "observed_logp"
        grads = pregrad_grads(total, continuous) if continuous else []
    for g, v in zip(grads, continuous):
        g.name = f"d_observed_logp/d_{v.name}"
    kwargs = {"on_unused_input": "ignore"}
    if mode is not None:
        kwargs["mode"] = mode
    f = synk.function(row_in + glob_in + rv_in, [(total, "sum")] + [(g, "sum") for g in grads],
                      bcast_inputs=glob_in + rv_in, name="pymc_observed_logp", **kwargs)
    synk.distribute()
    split = _Split(None, None, [], n_rows, [rv.name for rv in model.observed_RVs], derive=derive,
                   feature_major=frozenset(fm), padded=mask_in is not None, row_axes=tuple(axes))
    copies = {var: synk.data(split.stored(i, _value(leaf)), var=var, name=var.name)
              for i, (leaf, var) in enumerate(zip(row_leaves, row_in))}
    if derive is not None:
        computed = derive(*[split.rows_first(i, _value(leaf)) for i, leaf in enumerate(row_leaves)])
        copies.update({var: synk.data(split.layout(v), var=var, name=var.name) for var, v in zip(derived_in, computed)})
    if mask_in is not None:
        copies[mask_in] = split.mask = synk.data(split.row_mask(n_rows), var=mask_in, name=mask_in.name)
    grad_of = iter(range(1, 1 + len(grads)))
    declared = [None] * len(glob_in) + [next(grad_of) if v in continuous else None for v in rv_in]
    split.op = op = f.as_op(given=copies, grads={0: declared} if grads else None)
    if importlib.util.find_spec("numba") is not None:  # nutpie, and PyTensor 3's default backend
        register_numba()
    split.rows = [(leaf, copies[var], _value(leaf)) for leaf, var in zip(row_leaves, row_in)]
    split.derived = [copies[v] for v in derived_in]
    op.fn = _Following(op.fn, split)
    split.term = op(*glob, *values)[0] if (glob or values) else op()[0]
    return split


def _share_mode(mode, masked) -> tuple:
    """``(mode, whether it is JAX)`` of a share: ``"auto"`` leaves JAX where a boolean mask keeps
    rows (``"JAX"`` refuses); in JAX mode, XLA's flags set before JAX is imported."""
    if masked and _resolve_mode(mode) == "JAX":
        # a share's rows kept by a boolean mask have a count known at run time only: JAX's jit
        # takes no boolean index that is not a constant (NonConcreteBooleanIndexError at the call)
        if mode == "JAX":
            raise ValueError("mode='JAX': the observed terms keep rows by a per-row boolean mask, which JAX "
                             "cannot trace (a boolean index of rows is not a constant); give mode=None "
                             "(PyTensor's default backend) or mode='auto'")
        mode = None
    in_jax = _resolve_mode(mode) == "JAX"
    if in_jax and "jax" not in sys.modules:
        # the master's share on its own cores, with the workers' flags: set before anything
        # below imports JAX (laying out, rendering), which reads them once (until 2026-11-27
        # it was set after, so never: the master ran XLA's default threads and vectors)
        os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), available_cores())
    return mode, in_jax


def _laid_out_for_xla(local_terms, total, row_in, inputs, n_leaves, check) -> tuple:
    """The share as JAX mode lays out its rows: ``(total, row_in, inputs, feature-major
    positions, the row mask or None)``. With ``check`` (rows on axis 0 of every term, proved
    by split_rows), each process's rows padded to blocks and the copies masked out of the
    sum; per-row matrices read only by matrix products stored feature-major."""
    mask_in = pt.vector("rows_mask", dtype="bool") if check else None
    if mask_in is not None:
        total = pt.add(*[pt.switch(mask_in.dimshuffle(0, *["x"] * (t.type.ndim - 1)), t, 0).sum()
                         for t in local_terms])
        row_in, inputs = row_in + [mask_in], row_in + [mask_in] + inputs[len(row_in):]
    fm = _feature_major_rows(inputs, total, row_in[:n_leaves])
    stored = {row_in[i]: row_in[i].type(name=row_in[i].name) for i in fm}
    total = graph_replace(total, {x: cast(TensorVariable, FeatureMajor()(d)).T for x, d in stored.items()}, strict=False)
    total.name = "observed_logp"
    return total, [stored.get(v, v) for v in row_in], [stored.get(v, v) for v in inputs], fm, mask_in


def _feature_major_rows(inputs, total, row_in) -> set:
    """Positions in ``row_in`` of per-row matrices that the share, as XLA gets it, reads only
    as the left side of a matrix product: stored feature-major (see :mod:`synkhronos._integrations.xla_rewrites`)."""
    candidates = [i for i, v in enumerate(row_in) if v.type.ndim == 2 and v.type.dtype.startswith("float")]
    if not candidates:
        return set()
    fg = FunctionGraph(inputs, [total], clone=True)
    prepare_for_xla(fg)
    return {i for i in candidates if read_by_dots_only(fg, fg.inputs[inputs.index(row_in[i])])}


def _resolve_mode(mode):
    """``"JAX"`` where the share may go to JAX (``_jax_if_it_renders`` has the last word)."""
    return "JAX" if mode == "JAX" or (mode == "auto" and default_mode() == "JAX") else mode


def _jax_if_it_renders(mode, inputs, total, wrt) -> tuple:
    """``(mode, the share's JaxValueAndGrad or None)``, ``"auto"`` resolved: JAX where it is
    installed and PyTensor's JAX backend renders every op of the share, else PyTensor's
    default. ``mode="JAX"`` with an op that has no JAX rendering is a ValueError that names it."""
    if _resolve_mode(mode) != "JAX":
        return (None if mode == "auto" else mode), None
    op = JaxValueAndGrad(inputs, total, wrt)
    try:
        op.jax_function()
    except NotImplementedError as err:
        if mode == "auto":  # e.g. erfcx (a censored Normal) in PyTensor 2's JAX backend
            return None, None
        raise ValueError(f"mode='JAX': PyTensor's JAX backend cannot render the observed terms ({err}); "
                         "give mode=None (PyTensor's default backend) or install what the message names") from err
    return "JAX", op


class _Following:
    """The distributed function, called after the shared-memory copies of the per-row
    data have followed any ``pm.set_data`` (checked at every call: cheap)."""

    def __init__(self, fn, split: _Split):
        self.fn, self.split = fn, split
        self.name, self.output_modes = fn.name, fn.output_modes

    def __call__(self, *args):
        _follow_data(self.split)
        return self.fn(*args)


def _follow_data(split: _Split) -> None:
    """After ``pm.set_data`` on per-row data: the shared-memory copies follow, all or none."""
    changed = [(i, leaf) for i, (leaf, _, seen) in enumerate(split.rows)
               if isinstance(leaf, SharedVariable) and leaf.get_value(borrow=True) is not seen]
    if not changed:
        return
    counts = {leaf.name: split.row_count(i, _value(leaf)) for i, (leaf, _, _) in enumerate(split.rows)}
    if len(set(counts.values())) != 1:
        raise ValueError(f"pm.set_data left the per-row data with different row counts {counts}; set them "
                         "all to the same rows")
    for i, leaf in changed:
        _, data, _ = split.rows[i]
        value = _value(leaf)
        data.set_value(split.stored(i, value))
        split.rows[i] = (leaf, data, value)
    split.n_rows = next(iter(counts.values()))
    if split.derive is not None:  # their one rule: computed again from the rows whenever one changes
        rows_first = [split.rows_first(i, _value(leaf)) for i, (leaf, _, _) in enumerate(split.rows)]
        for data, value in zip(split.derived, split.derive(*rows_first)):
            data.set_value(split.layout(value))
    if split.mask is not None:
        split.mask.set_value(split.row_mask(split.n_rows))
    if split.checker is not None:  # data that couple rows can come with set_data: the check again
        split.checker.check(split.n_rows)
