"""Keras 3 helpers: a callback that syncs a model through a table every few batches.

Multiverso's ``theano_ext.keras_ext`` on Keras 3, with any of its backends
(PyTorch, JAX, TensorFlow)::

    model.fit(x, y, callbacks=[MVCallback(model)])

:class:`KerasParamManager` keeps every weight of a model in one flat array
table (through ``get_weights``/``set_weights``); :class:`MVCallback` syncs it
every ``freq`` training batches. Keras is optional (``pip install
'synkhronos[keras]'``, plus a backend, e.g. ``'synkhronos[keras,torch]'`` with
``KERAS_BACKEND=torch``) and is imported by this module only.
"""

from __future__ import annotations

from typing import cast

from .pytensor_ext.param_manager import MVModelParamManager

try:
    import keras
except ImportError as _err:
    if getattr(_err, "name", None) == "keras":
        raise ImportError("synkhronos.multiverso.keras_ext needs Keras 3: pip install "
                          "'synkhronos[keras]' (and a backend, e.g. 'synkhronos[keras,torch]' "
                          "with KERAS_BACKEND=torch)") from _err
    raise ImportError(f"Keras is installed but its backend could not be imported ({_err}); set "
                      "KERAS_BACKEND to an installed backend (torch, jax or tensorflow) before "
                      "Keras is first imported, e.g. KERAS_BACKEND=torch with pip install "
                      "'synkhronos[keras,torch]'") from _err

if isinstance(keras.__version__, str) and int(keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"synkhronos.multiverso.keras_ext needs Keras 3, found Keras "
                      f"{keras.__version__}: pip install 'synkhronos[keras]'")

__all__ = ["MVCallback", "KerasParamManager"]


def _check_model(model, what: str) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"{what} needs a keras.Model, got {type(model).__name__}")


class KerasParamManager(MVModelParamManager):
    """Every weight of a Keras 3 model (trainable or not) in one flat array table.

    Construction is collective (every worker, in the same order as its other
    tables): the table starts with the master's weights and every worker's
    model is set to them. ``sync_all_param()`` adds this worker's change
    since the last sync and loads the latest weights. The optimizer's own
    state (moments, step counts) stays with each worker, as in Multiverso.

    Args:
        model: a built ``keras.Model`` (it has its weights); the same
            architecture on every worker.

    Raises:
        TypeError: ``model`` is not a ``keras.Model``.
        ValueError: the model is not built yet (it has no weights).
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        WorkerFailedError: another worker failed.
    """

    def __init__(self, model):
        _check_model(model, "KerasParamManager")
        if not model.built or not model.weights:
            raise ValueError(f"KerasParamManager: the model {model.name!r} has no weights yet; build "
                             "it first (keras.Input in the model, model.build(shape) or one call "
                             "on data), or let MVCallback make the manager when fit() starts")
        super().__init__(model)

    def get_all_param_values(self):
        """The model's weights, ``model.get_weights()``."""
        return self.model.get_weights()

    def set_all_param_values(self, params):
        """``model.set_weights(params)``.

        Args:
            params: one array per weight, as :meth:`get_all_param_values` returns.
        """
        self.model.set_weights(params)


class MVCallback(keras.callbacks.Callback):
    """Syncs a model's weights through a table every ``freq`` training batches.

    Give it to ``model.fit(..., callbacks=[MVCallback(model)])`` on every
    worker. The weights start as the master's: when the model is built, the
    :class:`KerasParamManager` (``self.kpm``) is made here, as Multiverso's
    callback did; otherwise when ``fit()`` starts (every worker's
    ``on_train_begin``, collectively). The count of batches runs on across
    epochs and ``fit()`` calls. Updates after the last sync stay local: for
    one final model everywhere, ``mv.barrier()`` then
    ``callback.kpm.sync_all_param()`` after ``fit()``.

    Args:
        model: the ``keras.Model`` that ``fit()`` trains.
        freq: sync every ``freq`` batches (an int, 1 or more; default 1).

    Raises:
        TypeError: ``model`` is not a ``keras.Model``, or ``freq`` is not an int.
        ValueError: ``freq`` is below 1.
        SynkError: called before ``mv.init()`` or after ``mv.shutdown()``.
        WorkerFailedError: another worker failed.
    """

    def __init__(self, model, freq: int = 1):
        super().__init__()
        _check_model(model, "MVCallback")
        if isinstance(freq, bool) or not isinstance(freq, int):
            raise TypeError(f"MVCallback: freq must be an int (sync every freq batches), got {freq!r}")
        if freq < 1:
            raise ValueError(f"MVCallback: freq must be at least 1 (sync every freq batches), "
                             f"got {freq}")
        self.freq = freq
        self.cur_n = 0
        self.mv_model = model
        self.kpm = KerasParamManager(model) if model.built and model.weights else None

    def on_train_begin(self, logs=None):
        """Check that ``fit()`` trains this callback's model; make the manager if not made yet.

        Raises:
            ValueError: ``fit()`` trains another model than the one given.
        """
        trained = self.model
        if trained is not None and trained is not self.mv_model:
            raise ValueError(f"MVCallback was made for the model {self.mv_model.name!r} but fit() "
                             f"trains {trained.name!r}")
        if self.kpm is None:
            self.kpm = KerasParamManager(self.mv_model)

    def on_train_batch_end(self, batch, logs=None):
        """Count the batch; every ``freq``-th, sync all the weights."""
        self.cur_n = (self.cur_n + 1) % self.freq
        if self.cur_n == 0:
            _ = self.model  # JAX: attaches the trained state to the model before it is read
            cast(KerasParamManager, self.kpm).sync_all_param()  # (on_train_begin made it)
