"""PyTorch helper: a param manager that keeps a ``torch.nn.Module``'s parameters in one table.

``TorchParamManager(model)`` starts every worker's model from the master's
parameters; ``sync_all_param()`` adds this worker's change since the last sync
and loads the latest values, as :class:`~.pytensor_ext.MVModelParamManager`
does for PyTensor. It is the successor of Multiverso's Lua Torch pattern
(``params, grad = model:getParameters()`` kept in one ``ArrayTableHandler``).
PyTorch is optional (``pip install 'synkhronos[torch]'``); it is imported only
when a manager is made. The tables themselves take ``torch.Tensor`` data and
return tensors with ``get(as_tensor=True)``.
"""

from __future__ import annotations

import numpy as np

from .pytensor_ext.param_manager import MVModelParamManager
from .tables import as_numpy

__all__ = ["TorchParamManager"]


class TorchParamManager(MVModelParamManager):
    """A param manager for the parameters (and, optionally, buffers) of a ``torch.nn.Module``.

    Construction is collective (every worker, in the same order as its other
    tables): the table starts with the master's parameters and every
    worker's module is set to them. The module's parameters are updated in
    place, so an optimizer made before or after keeps working. Parameters on
    a GPU are copied through the CPU.

    Args:
        model: the module; the same architecture on every worker.
        buffers: also sync the module's floating-point buffers (batch-norm
            running statistics); integer buffers are left alone.

    Raises:
        ImportError: PyTorch is not installed.
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``buffers`` not a bool.
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        WorkerFailedError: another worker failed.
    """

    def __init__(self, model, buffers: bool = False):
        try:
            import torch
        except ImportError as err:
            raise ImportError("TorchParamManager needs PyTorch: pip install "
                              "'synkhronos[torch]' (or pip install torch)") from err
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchParamManager needs a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(buffers, bool):
            raise TypeError(f"TorchParamManager: buffers must be True or False, got {buffers!r}")
        self._torch = torch
        self._tensors: list[torch.Tensor] = list(model.parameters())
        if buffers:
            self._tensors += [b for b in model.buffers() if b.is_floating_point()]
        super().__init__(model)

    def get_all_param_values(self):
        """The parameters as numpy arrays (copied to the CPU when they live elsewhere;
        bfloat16 as float32)."""
        return [as_numpy(t, "TorchParamManager") for t in self._tensors]

    def set_all_param_values(self, params):
        """Copy new values into the parameters, in place (optimizers keep their references).

        Args:
            params: one array per parameter.
        """
        with self._torch.no_grad():
            for t, v in zip(self._tensors, params):
                t.copy_(self._torch.from_numpy(np.ascontiguousarray(v)).to(t.dtype))
