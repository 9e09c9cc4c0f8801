"""Hierarchical Communicator: inside each node, then among nodes, then inside again.

Under ``mpirun`` every node runs its own fork (a master and its workers, one
shared-memory or NCCL communicator each), and the node masters are joined by
an :class:`.mpi.MpiCommunicator`. A :class:`HierarchicalCommunicator` in every
process of every node makes of these one communicator over all of them, with
global ranks node-major (node 0's processes first, each node's in its local
rank order), as Horovod does:

1. inside the node, every process hands its part to the node master (a
   reduction through the local communicator; gathers and failure flags too);
2. the node masters alone run one MPI collective;
3. each node master shares the outcome inside its node (a local broadcast,
   which also carries whether anything failed anywhere).

Every process of a node runs the same local collectives in the same order,
whatever fails: an error in step 1 or 2 is remembered and flagged in the
next step, and raised at the end, so that a failure anywhere makes every
process of every node raise (:class:`PeerFailed` where nothing failed
locally) and no process is left waiting. ``avg`` weighs each node by the sum
of its contributing processes' weights, so it equals the flat average.
"""

from __future__ import annotations

import math
import pickle
from typing import TYPE_CHECKING, Any, Callable, cast

import numpy as np

from .._kept.records import Table
from .base import Communicator
from .hier_plans import NodePlan
from .ops import cast_to, result_dtype

from ..errors import PeerFailed

if TYPE_CHECKING:
    from .mpi import MpiCommunicator

__all__ = ["HierarchicalCommunicator", "NodeCommunicator", "MASTERS"]

#: ``root`` of a rooted reduce or gather meaning "every node's master" (each
#: gets the result; :class:`NodeCommunicator` roots its collectives there).
MASTERS = "masters"

_YES, _NO = np.ones(1, dtype=np.int8), np.zeros(1, dtype=np.int8)
#: A gather's part of a node that has joined: its head (the pickled None) and its bytes.
_JOINED_HEAD = np.frombuffer(pickle.dumps(None, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
_EMPTY = np.empty(0, dtype=np.uint8)


def _own_failure(failed) -> None:
    """A node of one process: its own failure is the node's (raised in the first step,
    it goes to the other nodes as the node's failure, as a local collective's flag does)."""
    if failed:
        raise PeerFailed(failed if isinstance(failed, str) else "its own part failed")


#: Kept reductions among nodes per (layout, op, weight) in a node master (each a few KiB).
_MIDDLES = 32


class HierarchicalCommunicator(Communicator):
    """One communicator over every process of every node.

    Args:
        local: this node's communicator (every process of the node).
        inter: in the node master (``local.rank == local.master_rank``), the
            communicator among node masters (:class:`.mpi.MpiCommunicator`,
            its rank is the node index); None in every other process.

    Creating it is collective over every process of every node (the node
    sizes are exchanged). ``rank``, ``size`` and ``master_rank`` are global;
    ``node``, ``nodes`` and ``node_sizes`` say where each process lives.
    """

    device_arrays = False
    supports_resident = False

    def __init__(self, local: Communicator, inter: MpiCommunicator | None):
        is_master = local.rank == local.master_rank
        if is_master != (inter is not None):
            raise ValueError("the node master (local.rank == local.master_rank) takes the inter-node "
                             f"communicator and no other process does; local rank {local.rank} of "
                             f"master {local.master_rank} got inter={inter!r}")
        self._local, self._inter, self._is_master = local, inter, is_master
        self._lm = local.master_rank
        self._alone = local.size == 1  # a node of one process: no local steps at all
        # the node master's small reductions among nodes, kept per (layout, op, weight): see _kept_middle
        self._middles = Table(_MIDDLES)
        shape = None
        if inter is not None:  # (the node master)
            parts = inter.all_gather([np.array([local.size, local.master_rank], dtype=np.int64)])[0]
            table = np.stack(parts)
            shape = [table, np.array([inter.rank, inter.master_rank], dtype=np.int64)]
        got = local.broadcast(shape, self._lm)
        table, (node, master_node) = np.asarray(got[0]), [int(x) for x in got[1]]
        self.node_sizes = [int(x) for x in table[:, 0]]
        self.nodes = len(self.node_sizes)
        self.node = node
        self.offsets = [sum(self.node_sizes[:k]) for k in range(self.nodes)]
        self.size = sum(self.node_sizes)
        self.rank = self.offsets[node] + local.rank
        self.master_rank = self.offsets[master_node] + int(table[master_node, 1])

    @property
    def check(self) -> Callable[[], None]:
        return self._local.check

    @check.setter
    def check(self, fn) -> None:
        self._local.check = fn
        if self._inter is not None:
            self._inter.check = fn

    def where(self, rank: int) -> tuple[int, int]:
        """``(node, local rank)`` of global ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be 0 to {self.size - 1}, got {rank!r}")
        node = max(k for k in range(self.nodes) if self.offsets[k] <= rank)
        return node, rank - self.offsets[node]

    # -- the three steps -----------------------------------------------------

    def _steps(self, first, middle, share):
        """``first()`` in every process of the node, ``middle(value, failed)`` in
        the node master, ``share(value, failed)`` in every process; the first
        error is raised after all three, in every process. ``middle`` gets the
        local failure as its reason (naming this node), which the other nodes
        then name in their :class:`PeerFailed`."""
        err = value = None
        try:
            value = first()
        except Exception as exc:  # noqa: BLE001 - raised after the next steps
            err = exc
        if self._is_master:
            reason = False if err is None else self._reason(err)[:200]
            try:
                value = middle(value, reason)
            except Exception as exc:  # noqa: BLE001
                err = err or exc
                value = None
        try:
            value = share(value, err is not None)
        except Exception as exc:  # noqa: BLE001
            err = err or exc
        if err is not None:
            raise err
        return value

    def _reason(self, err) -> str:
        """What failed in this node, as the other nodes' PeerFailed names it."""
        if isinstance(err, PeerFailed) and err.args and isinstance(err.args[0], list):
            ranks = err.args[0]  # the local ranks that flagged a failure
            first = self.offsets[self.node]
            return (f"local rank(s) {ranks} of node {self.node} (global rank(s) "
                    f"{[first + r for r in ranks]}) failed")
        return f"{type(err).__name__}: {err}"

    def _share(self, arrays, failed, receive=None):
        """Node master's ``arrays`` (None: nothing) in every process of the node."""
        if self._alone:
            return arrays
        payload = None
        if self._is_master:
            payload = [_NO] if arrays is None else [_YES, *arrays]
        rec = None
        if receive is not None:
            def rec(i, a):  # the marker first, then the arrays
                return np.array(a) if i == 0 else receive(i - 1, a)
        got = self._local.broadcast(payload, self._lm, failed=failed, receive=rec)
        if not int(np.asarray(got[0])[0]):
            return None
        return list(got[1:])

    def _verdict(self, value, bad):
        """The third step when the result stays with the node masters: only
        whether anything failed travels inside the node."""
        self._share(None, bad)
        return value if self._is_master else None

    # -- collectives -----------------------------------------------------------

    def barrier(self) -> None:
        self._local.barrier()
        if self._inter is not None:  # (the node master)
            self._inter.barrier()
        self._local.barrier()

    def _node_part(self, arrays, op, weight, failed):
        """Step 1 of a reduction: ``(the node's reduced arrays, the node's weight
        in an avg)`` in the node master (None elsewhere, and where nothing)."""
        local, lm = self._local, self._lm
        if self._alone:  # this process's arrays are the node's part
            _own_failure(failed)
            if arrays is None:
                return None, None
            return [np.asarray(a).astype(result_dtype(np.asarray(a).dtype, op), copy=False)
                    for a in arrays], float(weight)
        # both local calls run whatever happens: every process of the node
        # must make the same calls
        wsum = err = None
        if op == "avg":  # the node's weight in the average among nodes
            try:
                ws = local.gather(None if arrays is None else [np.array([float(weight)])], lm,
                                  failed=failed)
                if ws:  # on the master; [] when no process of the node contributes
                    wsum = sum(float(p[0]) for p in ws[0] if p is not None)
            except Exception as exc:  # noqa: BLE001
                err = exc
        try:
            part = local.reduce(arrays, op, lm, weight=weight, failed=failed or err is not None)
        except Exception as exc:  # noqa: BLE001
            err = err or exc
        if err is not None:
            raise err
        return part, wsum

    def _reduce(self, arrays, op, root, weight, failed, in_place=False):
        lm = self._lm
        root_node = root_local = None
        if root is not None and root is not MASTERS:
            root_node, root_local = self.where(root)

        def first():
            return self._node_part(arrays, op, weight, failed)

        def middle(value, bad):
            inter = cast("MpiCommunicator", self._inter)  # (middle runs in the node master)
            part, wsum = value if value is not None else (None, None)
            w = 1.0 if wsum is None else wsum
            if root is None or root is MASTERS:
                return self._among_masters(inter, part, op, w, bad, arrays, in_place and root is None)
            out = inter.reduce(part, op, root_node, weight=w, failed=bad)
            return out

        if root is None:
            def share_everywhere(value, bad):
                receive = None
                if in_place and arrays is not None and not self._is_master:
                    def receive(i, a):
                        np.copyto(arrays[i], cast_to(a, arrays[i].dtype))
                        return arrays[i]
                out = self._share(value, bad, receive)
                if in_place and arrays is not None and out is not None and self._is_master:
                    for dst, src in zip(arrays, out):
                        if not np.shares_memory(dst, src):
                            np.copyto(dst, cast_to(src, dst.dtype))
                    return list(arrays)
                return out
            return self._steps(first, middle, share_everywhere)
        if root is MASTERS:
            return self._steps(first, middle, self._verdict)

        def share(value, bad):
            mine = self.node == root_node and root_local != lm
            got = self._share(value if mine else None, bad)
            if self.rank != root:
                return None
            return value if root_local == lm else got
        return self._steps(first, middle, share)

    def _among_masters(self, inter, part, op, weight, bad, arrays=None, in_place=False):
        """Step 2 of a reduction whose result every node master gets: the node's ``part``
        (None: nothing) reduced among the nodes, through a kept plan where there is one.
        ``arrays``: the caller's own (``in_place``: the result goes into them)."""
        got = None if bad or part is None else self._kept_middle(inter, part, op, weight)
        if got is not None:
            return got
        # MPI works in the node's part when that is ours to overwrite: a
        # fresh local result, or the caller's own arrays when in place
        fresh = part is not None and (arrays is None or not any(
            np.may_share_memory(p, a) for p, a in zip(part, arrays)))
        if in_place and fresh and arrays is not None:
            # straight into this master's own arrays, which the node then shares
            return inter.all_reduce(part, op, weight=weight, failed=bad, into=list(arrays))
        return inter.all_reduce(part, op, weight=weight, failed=bad, in_place=bool(in_place or fresh))

    def _kept_middle(self, inter, part, op, weight):
        """The node master's reduction among nodes of its node's ``part`` (every node's
        result, new arrays) through a kept :class:`.mpi_plans.CallPlan` of its layout, op and
        ``weight``: the full path's exchange with its header made once, every node's header
        compared byte for byte and read the long way where they differ, as the full path
        would. None when there is no such plan (then the full path runs). Each plan is a
        pure function of its key and this communicator: kept while the communicator lives."""
        layout = tuple((a.dtype, a.shape) for a in part)
        key = (layout, op, weight)
        plan: Any = self._middles.get(key)
        if plan is None:  # (False kept: no plan for this key, asked once)
            plan = self._middles.keep(key, inter.plan("reduce", layout, (op,) * len(part), weight=weight) or False)
        if plan is False:
            return None
        got: list = [None] * len(part)
        return got if plan.run(part, got) else None

    def reduce(self, arrays, op, root, weight=1.0, failed=False):
        """``op`` over every process's arrays; the result on global rank ``root``."""
        return self._reduce(arrays, op, root, weight, failed)

    def all_reduce(self, arrays, op, weight=1.0, failed=False, in_place=False):
        """``op`` over every process's arrays; the result everywhere (``in_place``:
        written into this process's arrays, rounded as :func:`.ops.cast_to`)."""
        return self._reduce(arrays, op, None, weight, failed, in_place)

    def _gather(self, arrays, root, failed, join):
        local, lm = self._local, self._lm
        root_node = None
        if root is not None and root is not MASTERS:
            root_node, _ = self.where(root)

        def first():
            if self._alone:
                _own_failure(failed)
                return None if arrays is None else [[a] for a in arrays]
            return local.gather(arrays, lm, failed=failed)

        def middle(parts, bad):
            return self._gather_middle(cast("MpiCommunicator", self._inter), parts, bad, root, root_node)

        if root is MASTERS:
            def verdict(packed, bad):
                self._share(None, bad)
                return self._unpack(packed, join) if self._is_master else None
            return self._steps(first, middle, verdict)

        def share(packed, bad):
            # to every process (all_gather), or to the root when it is a worker
            sends = root is None or (self.node == root_node and root != self.offsets[root_node] + lm)
            got = self._share(packed if sends else None, bad)
            if root is not None and self.rank != root:
                return None
            return self._unpack(packed if self._is_master else got, join)

        return self._steps(first, middle, share)

    def _gather_middle(self, inter, parts, bad, root, root_node):
        """Step 2 of a gather, in the node master: the node's ``parts`` (per array, the list
        over its processes) as two arrays, a pickled layout then every present part's
        bytes, gathered among the nodes (to every master, or to ``root_node``'s): what
        :meth:`_unpack` reads, or None where nothing comes."""
        lays, chunks = [], []
        for per_array in parts or ():
            lay: list[tuple | None] = []
            for p in per_array:
                if p is None:
                    lay.append(None)
                else:
                    p = np.asarray(p)
                    lay.append((p.dtype, p.shape))  # (ascontiguousarray makes 0-d arrays 1-d)
                    chunks.append(np.ascontiguousarray(p).reshape(-1).view(np.uint8))
            lays.append(lay)
        head = np.frombuffer(pickle.dumps(lays, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        blob = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.uint8)
        if root is None or root is MASTERS:
            got = inter.all_gather([head, blob], failed=bad)
        else:
            got = inter.gather([head, blob], root_node, failed=bad)
        if got is None:
            return None
        # a node that has joined (synk.join()) gave nothing: a head saying so, which the
        # node's processes receive as arrays (an all_gather shares this inside the node)
        return [a for node in range(self.nodes) for a in
                ((got[0][node], got[1][node]) if got[0][node] is not None else (_JOINED_HEAD, _EMPTY))]

    def _unpack(self, packed, join):
        per_node: list[tuple[list, np.ndarray]] = []
        for node in range(self.nodes):
            lays = None if packed[2 * node] is None else pickle.loads(np.asarray(packed[2 * node]).tobytes())
            if lays is None:  # a node that has joined (synk.join()): nothing of its own
                per_node.append(([], _EMPTY))
                continue
            per_node.append((lays, np.asarray(packed[2 * node + 1])))
        counts = {len(lays) for lays, _ in per_node if lays}
        if len(counts) > 1:
            raise ValueError(f"cannot gather: the nodes hold different numbers of arrays "
                             f"{[len(lays) for lays, _ in per_node]}")
        n = counts.pop() if counts else 0
        parts: list[list] = [[] for _ in range(n)]
        for node, (lays, blob) in enumerate(per_node):
            offset = 0
            for i in range(n):
                for lay in (lays[i] if lays else [None] * self.node_sizes[node]):
                    if lay is None:
                        parts[i].append(None)
                        continue
                    dtype, shape = lay
                    nbytes = math.prod(shape) * np.dtype(dtype).itemsize  # (shape: a tuple of ints)
                    parts[i].append(blob[offset:offset + nbytes].view(dtype).reshape(shape))
                    offset += nbytes
        return [p if join is None else join(i, p) for i, p in enumerate(parts)]

    def gather(self, arrays, root, failed=False, join=None):
        """On global rank ``root``, for each array, the list over global ranks of
        its copies (None where absent), or ``join(i, parts)``; None elsewhere."""
        return self._gather(arrays, root, failed, join)

    def all_gather(self, arrays, failed=False, join=None):
        """As :meth:`gather`, in every process."""
        return self._gather(arrays, None, failed, join)

    def broadcast(self, arrays, root, failed=False, receive=None):
        """Global rank ``root``'s arrays in every process (root gets its own)."""
        local, lm = self._local, self._lm
        root_node, root_local = self.where(root)
        on_root_node = self.node == root_node
        relay = on_root_node and root_local != lm  # a worker's values go to its master first

        def first():
            if relay:
                return local.broadcast(arrays if local.rank == root_local else None, root_local,
                                       failed=failed)
            return arrays if self.rank == root else None

        def middle(value, bad):
            inter = cast("MpiCommunicator", self._inter)  # (middle runs in the node master)
            bad = bad or (self.rank == root and bool(failed))
            return inter.broadcast(value if on_root_node else None, root_node, failed=bad)

        def share(value, bad):
            if relay:  # the node has the values already: only the verdict travels
                self._share(None, bad)
                return value
            got = self._share(value, bad)
            return value if self._is_master else got

        out = self._steps(first, middle, share)
        if self.rank == root:
            return arrays
        if receive is not None:
            out = [receive(i, a) for i, a in enumerate(out)]
        return out

    def close(self) -> None:
        """Close the inter-node communicator (collective among node masters)
        and this node's communicator."""
        if self._inter is not None:
            self._inter.close()
        self._local.close()


class NodeCommunicator(HierarchicalCommunicator):
    """The communicator of every process of a fork that joined other nodes
    (``synk.fork()`` under ``mpirun`` or ``srun``): a hierarchical
    communicator whose rooted collectives are rooted at the masters.

    ``rank`` and ``size`` are global (node-major), as in
    :class:`HierarchicalCommunicator`; ``master_rank`` is the node master's
    rank *inside its node*, as it is in a fork of one node, and it is the
    only root a rooted collective takes: ``reduce`` and ``gather`` deliver
    their result to every node's master, ``broadcast`` sends node 0's
    master's arrays everywhere. So the code that runs a function's output
    reductions or a shared-variable collective on one node runs unchanged
    across nodes, and every node's call returns the same value.
    ``first_master`` is the global rank of node 0's master; shared-memory
    homes (``resident`` and the rest) are the node's own communicator's.
    """

    def __init__(self, local: Communicator, inter: MpiCommunicator | None):
        super().__init__(local, inter)
        self.first_master = self.master_rank
        self.master_rank = local.master_rank
        self.local_rank, self.local_size = local.rank, local.size
        self.supports_resident = local.supports_resident

    @property
    def inter(self) -> MpiCommunicator | None:
        """The communicator among node masters (in a node master), else None."""
        return self._inter

    def _at_masters(self, root, what: str):
        if root != self.master_rank:
            raise ValueError(f"{what}: across nodes a collective is rooted at the masters: root must be "
                             f"master_rank ({self.master_rank}), got {root!r}")
        return MASTERS

    def reduce(self, arrays, op, root, weight=1.0, failed=False):
        """``op`` over every process of every node; the result on every node master."""
        return self._reduce(arrays, op, self._at_masters(root, "reduce"), weight, failed)

    def gather(self, arrays, root, failed=False, join=None):
        """Every process's arrays, node-major, on every node master."""
        return self._gather(arrays, self._at_masters(root, "gather"), failed, join)

    def broadcast(self, arrays, root, failed=False, receive=None):
        """Node 0's master's arrays in every process of every node."""
        self._at_masters(root, "broadcast")
        return super().broadcast(arrays, self.first_master, failed, receive)

    # -- steps among nodes (forwarded to ``inter`` in the node master; no-ops elsewhere)

    def node_table(self) -> tuple[int, list[int]]:
        return self.node, list(self.node_sizes)

    def among_nodes(self):
        return self._inter

    def begin_step(self, key, words, command: bool = False) -> None:
        inter = self._inter
        if inter is None:
            return
        if command and inter.pre_begun:  # the step that came with the values stands for it
            inter.pre_begun = False
            return
        inter.begin(key, words)

    def values_begun(self) -> None:
        if self._inter is not None:
            self._inter.pre_begun = True

    def steps_begun(self) -> int | None:
        return None if self._inter is None else self._inter.begun

    def fail_step(self, what: str, reason: str | list, begun: bool) -> None:
        inter = self._inter
        if inter is not None:
            inter.pre_begun = False
            inter.fail_step(what, self._reason(PeerFailed(reason))[:200] if isinstance(reason, list) else reason, begun)

    @property
    def inline_outputs(self) -> bool:
        """In a node of several processes, as its own communicator's: the node master
        combines its node's outputs, then :meth:`reduce_node_part` (a node of one
        process keeps its reduction among the nodes instead, see ``_function/reduce.py``)."""
        return not self._alone and self._local.inline_outputs

    def reduce_node_part(self, part, op, weight=1.0, failed=False):
        """The exchange among nodes of a reduce of this node's ``part`` (see
        :meth:`.base.Communicator.reduce_node_part`), exactly as :meth:`reduce` makes it once
        the node's processes reduced: the same kept plan or full exchange, the same header
        (``weight`` 1.0 where ``part`` is None or ``op`` is not ``avg``). ``failed``: False,
        a reason, or the local ranks that failed (named as :meth:`reduce` names them)."""
        inter = self._inter
        if inter is None:
            raise ValueError("reduce_node_part: only the master of a node reduces among the nodes")
        bad = self._reason(PeerFailed(failed))[:200] if isinstance(failed, list) else failed
        return self._among_masters(inter, part, op, weight if op == "avg" and part is not None else 1.0, bad)

    def gather_node_part(self, parts, failed=False, join=None):
        """The exchange among nodes of a gather of this node's ``parts`` (see
        :meth:`.base.Communicator.gather_node_part`), exactly as :meth:`gather` makes it once
        the node's processes gathered (the same two arrays, the same all-gather). ``failed``:
        False, a reason, or the local ranks that failed (named as :meth:`gather` names them)."""
        inter = self._inter
        if inter is None:
            raise ValueError("gather_node_part: only the master of a node gathers among the nodes")
        bad = self._reason(PeerFailed(failed))[:200] if isinstance(failed, list) else failed
        return self._unpack(self._gather_middle(inter, parts, bad, MASTERS, None), join)

    def nodes_joined(self) -> list:
        return [] if self._inter is None else self._inter.joined

    def join(self) -> int:
        return 0 if self._inter is None else self._inter.join()

    def leave(self, reason: str) -> None:
        if self._inter is not None:
            self._inter.leave(reason)

    def abandon(self, reason: str) -> bool:
        inter = self._inter
        if inter is None or inter.broken is not None:
            return False
        inter.abort(reason)
        return True

    def broken_among_nodes(self) -> bool:
        return self._inter is not None and self._inter.broken is not None

    def waiting_among_nodes(self) -> str | None:
        return None if self._inter is None else self._inter.waiting

    def plan(self, kind, layout, op, step=None, reducers=None, weight=1.0):
        """In the node master of a node of one process: the inter-node communicator's
        plan (:meth:`.mpi.MpiCommunicator.plan`); of a node of several processes, a
        small all_reduce's :class:`.hier_plans.NodePlan` (with ``step`` and
        ``reducers``); None elsewhere (the full path)."""
        inter = self._inter
        if inter is None:
            return None
        if self._alone:
            return inter.plan(kind, layout, op, step, weight=weight)
        if kind != "all_reduce" or step is None or reducers is None or layout is None:
            return None
        return NodePlan.make(self._local, inter, layout, op, step, reducers)

    # the node's home board (a worker publishes, the node master reads): the local communicator's

    @property
    def home_slots(self) -> int:  # type: ignore[override]
        return self._local.home_slots

    def publish_home(self, slot: int, view) -> int:
        return self._local.publish_home(slot, view)

    def home_board(self, rank: int) -> memoryview:
        return self._local.home_board(rank)

    def reset(self) -> None:
        self._local.reset()

    def local_reset(self) -> None:
        self._local.local_reset()

    def resident(self, key, dtype, shape, fresh=False):
        return self._local.resident(key, dtype, shape, fresh)

    def existing(self, key, dtype, shape):
        return self._local.existing(key, dtype, shape)

    def drop_resident(self, key) -> None:
        self._local.drop_resident(key)

    def resident_ranges(self) -> list:
        return self._local.resident_ranges()
