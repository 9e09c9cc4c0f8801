"""This node among all nodes: :func:`world` (where it stands), :func:`shard` (its rows
of a dataset) and :func:`join` (a node out of data waits for the others)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from . import _state as state
from ._batching import split
from ._protocol.across_nodes import inter_comm, liveness
from .errors import SynkError

__all__ = ["World", "world", "shard", "join"]


@dataclasses.dataclass(frozen=True)
class World:
    """Where this node's master stands among every process of every node.

    Attributes:
        node: this node's index, 0 to ``nodes - 1`` (the launcher's rank).
        nodes: the number of nodes (launched copies of the script); 1 without a launcher.
        rank: this master's global rank (node-major: node 0's processes
            first, each node's in its local rank order).
        size: the number of processes of every node together.
        local_size: this node's processes (its ``fork()``'s ``n_parallel``).
        master_rank: the master's rank inside its node, as given to ``fork()``.
        node_sizes: the number of processes of each node, in node order.
        first_rank: the global rank of this node's first process.
    """

    node: int
    nodes: int
    rank: int
    size: int
    local_size: int
    master_rank: int
    node_sizes: tuple
    first_rank: int


def world() -> World:
    """This node's place among all nodes: node index, node count, global rank and size.

    Works with and without a launcher: on one machine it is node 0 of 1,
    and the global rank and size are the fork's own.

    Returns:
        A read-only :class:`World` record.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
    """
    proc = state.running_session().proc
    comm = proc.comm
    table = comm.node_table()
    if table is not None:
        node, sizes = table
        return World(node, len(sizes), comm.rank, comm.size, proc.size, proc.master_rank,
                     tuple(sizes), sum(sizes[:node]))
    return World(0, 1, proc.rank, proc.size, proc.size, proc.master_rank, (proc.size,), 0)


def shard(n_rows: int) -> slice:
    """This node's rows of a dataset of ``n_rows`` rows, as a slice.

    Every node loads (or keeps) only ``data[synk.shard(len(data))]`` and
    passes it to its calls. Nodes get contiguous blocks in node order, sized
    by their number of processes, so every process of every node computes
    on about the same number of rows; together the blocks cover every row
    once. Without a launcher it is every row.

    Args:
        n_rows: the number of rows of the whole dataset (the same on every node).

    Returns:
        ``slice(start, stop)`` of this node's rows.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        TypeError, ValueError: ``n_rows`` not a non-negative int.
    """
    if isinstance(n_rows, bool) or not isinstance(n_rows, (int, np.integer)):
        raise TypeError(f"n_rows must be an int (the dataset's number of rows), got {n_rows!r}")
    if n_rows < 0:
        raise ValueError(f"n_rows must be 0 or more, got {n_rows}")
    w = world()
    start, _ = split(int(n_rows), w.size, w.first_rank)
    _, stop = split(int(n_rows), w.size, w.first_rank + w.local_size - 1)
    return slice(start, stop)


@state.serialized
def join() -> int:
    """This node has no more data: wait, taking part in the other nodes' steps, until
    every node has called ``join()``.

    For uneven inputs across nodes (a training loop over shards of different
    lengths), as PyTorch's ``Join`` and Horovod's ``hvd.join()``: a node that
    runs out of batches calls ``synk.join()``; the others' calls and collectives
    go on without it, its processes adding nothing (a sum over the rows that
    were passed, an ``avg`` over their weights, gathers without its rows), until
    they call ``join()`` too. Then ``join()`` returns on every node and the
    nodes step together again. While a node is joined its shared variables
    take no part: a collective that reads values from it (a ``broadcast``,
    ``scatter`` or ``set_value`` from node 0 when node 0 joined), a ``scatter``
    (its rows would be lost) and a ``set_value``/``get_value`` of one of its
    ranks raise ``ValueError`` on every node taking part; ``gather``,
    ``all_gather``, ``get_lengths`` and ``get_shapes`` leave it out; and
    variables the others updated differ on it afterwards
    (``synk.broadcast`` them from the node ``join()`` returns, if they must
    agree). Without ``join()``, a node that makes a step the others do not
    gets :class:`~synkhronos.StepMismatchError` naming theirs.

    On one node (no launcher) it returns 0 at once.

    Returns:
        The index of the node that joined last (the smallest, if several
        joined in the same step): the same on every node.

    Raises:
        RuntimeError: before :func:`synkhronos.fork`.
        NodeFailedError: another node failed or left while this one waited.
        SynkError: the other nodes closed without joining (this node's
            ``synk.close()`` then closes its own fork only); or ``synk.close()``
            was called meanwhile (a signal handler, another thread): the fork
            is then closed.
    """
    s = state.running_session()
    s.usable()
    inter = inter_comm(s.proc)
    if inter is None:
        return 0
    saved = inter.check

    def check() -> None:  # the node's workers, and close() from a signal handler or another thread
        saved_poll()
        if s.close_requested:
            raise _CloseDuringJoin()

    saved_poll = liveness(saved)
    inter.check = check
    # a command as far as close() knows: called meanwhile (a signal handler), it ends join() first
    s.in_flight = threading.get_ident()
    try:
        return s.proc.comm.join()
    except _CloseDuringJoin:
        raise SynkError("synk.close() was called (from another thread or a signal handler) during "
                        "join(); this node stopped waiting for the others (they were told) and its "
                        "fork is closed") from None
    finally:
        s.in_flight = None
        inter.check = saved
        s.close_if_requested()


class _CloseDuringJoin(BaseException):
    """close() was asked for while this node master waited in join()."""

    notice = "synk.close() was called there during join() (from another thread or a signal handler)"
