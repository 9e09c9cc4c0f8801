"""Alias of :mod:`synkhronos.multiverso.pytensor_ext`, so that ported Multiverso imports work.

``from multiverso.theano_ext import sharedvar`` becomes
``from synkhronos.multiverso.theano_ext import sharedvar``, and
``multiverso.theano_ext.param_manager`` likewise: the very same modules.
"""

import sys

from .. import pytensor_ext
from ..pytensor_ext import (MVModelParamManager, MVSharedVariable, SharedVarParamManager,
                            mv_shared, param_manager, sharedvar, sync_all_mv_shared_vars)

sys.modules[__name__ + ".sharedvar"] = sharedvar
sys.modules[__name__ + ".param_manager"] = param_manager

__all__ = pytensor_ext.__all__ + ["sharedvar", "param_manager"]
