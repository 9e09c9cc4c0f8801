"""Parameter-server tables with Multiverso's Python API, on one machine or under ``mpirun``.

``import synkhronos.multiverso as mv``; then ``mv.init()`` forks the workers
(or, under an MPI launcher, joins the launched ranks) and every worker runs
the rest of the script. See the "Parameter-server tables" page of the docs.
"""

from .api import (barrier, init, is_master_worker, server_id, shutdown, under_launcher,
                  worker_id, workers_num)
from ..errors import WorkerFailedError
from .tables import ArrayTableHandler, MatrixTableHandler, TableHandler

__all__ = ["init", "shutdown", "barrier", "workers_num", "worker_id", "server_id",
           "is_master_worker", "under_launcher", "TableHandler", "ArrayTableHandler",
           "MatrixTableHandler", "WorkerFailedError"]
