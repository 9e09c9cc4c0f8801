"""PyTensor helpers for parameter-server tables (Multiverso's ``theano_ext``, on PyTensor).

``mv_shared`` makes a shared variable backed by a table, with a working
``mv_sync()``; ``sync_all_mv_shared_vars()`` syncs every one of them; the
param managers keep a whole model in one flat table.
"""

from .param_manager import MVModelParamManager, SharedVarParamManager
from .sharedvar import MVSharedVariable, mv_shared, sync_all_mv_shared_vars

__all__ = ["mv_shared", "sync_all_mv_shared_vars", "MVSharedVariable", "MVModelParamManager",
           "SharedVarParamManager"]
