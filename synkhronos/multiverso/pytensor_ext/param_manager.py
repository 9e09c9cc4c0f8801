"""Param managers: a whole model's parameters in one flat array table."""

from __future__ import annotations

import numpy as np

from .. import api
from ..tables import ArrayTableHandler
from .sharedvar import cast_back

__all__ = ["MVModelParamManager", "SharedVarParamManager"]


class MVModelParamManager:
    """Keeps every parameter of a model in one flat table and syncs them together.

    Subclass it and implement :meth:`get_all_param_values` and
    :meth:`set_all_param_values` (as Multiverso's manager). Construction is
    collective: the table starts with the master's parameters and every
    worker's model is set to them. The table is float32 when every parameter
    is float32, else float64 (Multiverso supported float32 only).

    Args:
        model: whatever the two methods read and write.

    Raises:
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        TypeError: a parameter is not an array of real numbers.
        WorkerFailedError: another worker failed.
    """

    def __init__(self, model):
        self.model = model
        values = [np.asarray(v) for v in self.get_all_param_values()]
        for i, v in enumerate(values):
            if v.dtype.kind not in "biuf":
                raise TypeError(f"{type(self).__name__}: parameter {i} has dtype {v.dtype}; "
                                "tables hold real numbers")
        self.shapes = [v.shape for v in values]
        self.dtypes = [v.dtype for v in values]
        self.sizes = [v.size for v in values]
        dtype = np.float32 if values and all(d == np.float32 for d in self.dtypes) else np.float64
        flat = (np.concatenate([v.reshape(-1) for v in values]).astype(dtype)
                if values else np.zeros(0, dtype))
        self.tbh = ArrayTableHandler(max(flat.size, 1), dtype=dtype,
                                     init_value=flat if flat.size else None)
        api.barrier()  # the master's values are in before anyone reads them
        self.all_param_list = self.tbh.get()
        api.barrier()  # and nobody adds before everyone has read them
        self._set_all_param_to_model()

    def get_all_param_values(self):
        """The model's parameters: a list of numpy arrays (to be implemented).

        Raises:
            NotImplementedError: always, here.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement get_all_param_values()")

    def set_all_param_values(self, params):
        """Set the model's parameters from a list like :meth:`get_all_param_values` returns
        (to be implemented).

        Args:
            params: a list of numpy arrays.

        Raises:
            NotImplementedError: always, here.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement set_all_param_values()")

    def _set_all_param_to_model(self):
        params, n = [], 0
        for shape, dtype, size in zip(self.shapes, self.dtypes, self.sizes):
            params.append(cast_back(self.all_param_list[n:n + size].reshape(shape), dtype))
            n += size
        self.set_all_param_values(params)

    def sync_all_param(self) -> None:
        """Add every parameter's change since the last sync, then load the latest values.

        Raises:
            SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
            WorkerFailedError: another worker failed.
        """
        current = np.zeros_like(self.all_param_list)
        n = 0
        for v in self.get_all_param_values():
            v = np.asarray(v).reshape(-1)
            current[n:n + v.size] = v
            n += v.size
        self.tbh.add(current - self.all_param_list)
        self.all_param_list = self.tbh.get()
        self._set_all_param_to_model()


class SharedVarParamManager(MVModelParamManager):
    """A param manager for a list of PyTensor shared variables (what the Lasagne
    manager did for a network's parameters; Lasagne itself needs Theano).

    Args:
        params: the shared variables, e.g. ``[W, b]``; the same list, in the
            same order, on every worker.

    Raises:
        TypeError: ``params`` is not a list of PyTensor shared variables.
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        WorkerFailedError: another worker failed.
    """

    def __init__(self, params):
        from pytensor.compile.sharedvalue import SharedVariable

        params = list(params)
        for p in params:
            if not isinstance(p, SharedVariable):
                raise TypeError(f"SharedVarParamManager needs PyTensor shared variables, got "
                                f"{type(p).__name__} ({p!r:.60})")
        super().__init__(params)

    def get_all_param_values(self):
        """The values of the shared variables."""
        return [p.get_value(borrow=True) for p in self.model]

    def set_all_param_values(self, params):
        """Set each shared variable (a copy of its new value).

        Args:
            params: one array per shared variable.
        """
        for p, v in zip(self.model, params):
            p.set_value(np.array(v, dtype=p.dtype, copy=True), borrow=True)
