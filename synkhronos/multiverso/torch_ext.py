"""PyTorch helper: a param manager that keeps a ``torch.nn.Module``'s parameters in one table.

``TorchParamManager(model)`` starts every worker's model from the master's
parameters; ``sync_all_param()`` adds this worker's change since the last sync
and loads the latest values, as :class:`~.pytensor_ext.MVModelParamManager`
does for PyTensor. Needs PyTorch (``pip install torch``).
"""

from __future__ import annotations

import numpy as np

from .pytensor_ext.param_manager import MVModelParamManager

__all__ = ["TorchParamManager"]


class TorchParamManager(MVModelParamManager):
    """A param manager for the parameters (and, optionally, buffers) of a ``torch.nn.Module``.

    Args:
        model: the module; the same architecture on every worker.
        buffers: also sync the module's floating-point buffers (batch-norm statistics).

    Raises:
        ImportError: PyTorch is not installed.
        TypeError: ``model`` is not a ``torch.nn.Module``.
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        WorkerFailedError: another worker failed.
    """

    def __init__(self, model, buffers: bool = False):
        try:
            import torch
        except ImportError as err:
            raise ImportError("TorchParamManager needs PyTorch: pip install torch") from err
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchParamManager needs a torch.nn.Module, got {type(model).__name__}")
        self._torch = torch
        self._tensors = list(model.parameters())
        if buffers:
            self._tensors += [b for b in model.buffers() if b.is_floating_point()]
        super().__init__(model)

    def get_all_param_values(self):
        """The parameters as numpy arrays (copied to the CPU when they live elsewhere)."""
        return [t.detach().cpu().numpy() for t in self._tensors]

    def set_all_param_values(self, params):
        """Copy new values into the parameters, in place (optimizers keep their references).

        Args:
            params: one array per parameter.
        """
        with self._torch.no_grad():
            for t, v in zip(self._tensors, params):
                t.copy_(self._torch.from_numpy(np.ascontiguousarray(v)).to(t.dtype))
