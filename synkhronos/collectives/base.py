"""The Communicator interface every backend implements."""

from __future__ import annotations

import abc
from typing import Callable, Sequence

import numpy as np

__all__ = ["CommPlan", "Communicator"]


class CommPlan(abc.ABC):
    """What a communicator does for one kept collective: agreed once, in the
    full-path step that made it; each later :meth:`run` carries
    :attr:`fingerprint` (its layout, dtypes, counts and op, as every process
    agreed them), which every process compares before anything is combined.

    The engine (:mod:`synkhronos._kept.plans`) keeps a plan per collective
    argument and runs it while its validity rule holds; ``run`` returning False
    sends the call the full path, which agrees again (and raises there, on
    every process, when the processes' values no longer agree).
    """

    #: The processes' common word for this plan's agreement (compared at each run).
    fingerprint: int = 0
    #: Results go into ``outs`` (arrays the engine gives: a spare home per value), not the values.
    out_of_place: bool = False
    #: Writes into the values themselves: the engine refuses to run it while
    #: another shared variable holds one of them.
    needs_exclusive: bool = False

    @abc.abstractmethod
    def run(self, values, outs=None) -> bool:
        """The collective on ``values`` (one array per variable, the plan's layout):
        True once done (results in ``values``, or in ``outs`` when
        :attr:`out_of_place`); False, having sent nothing, when the values left the
        plan (another type, dtype or shape). Raises as the full path would when
        another process's step does not agree."""


class Communicator(abc.ABC):
    """Collectives over lists of arrays among all the processes of one fork.

    Every process calls the same method in the same order (SPMD). A process
    may contribute ``None`` to ``reduce``, ``all_reduce``, ``gather`` and
    ``all_gather`` when it has nothing to add (it computed on no rows); the
    reduction then runs over the processes that did contribute.
    ``weight`` scales a process's contribution to ``avg``. ``failed=True`` in
    any process makes every process raise ``PeerFailed``
    before anything is combined. ``root`` is only ever the per-call argument;
    ``master_rank`` is the rank of the process that called ``fork()``.
    """

    rank: int
    size: int
    master_rank: int
    #: Called between wait slices: raises when a peer died or the command was abandoned.
    check: Callable[[], None]
    #: Takes and returns device (CuPy/JAX) arrays as they are, not numpy arrays.
    device_arrays: bool = False
    #: ``resident``, ``existing``, ``drop_resident`` and ``resident_ranges`` work.
    supports_resident: bool = False
    #: Its processes are exactly those of one fork (one control block reaches
    #: them all), and it takes host arrays: small function outputs may skip it
    #: and ride back with the workers' answers instead.
    within_fork: bool = False
    #: Slots of each process's home board (0: none): a worker publishes where the
    #: values of its kept small collectives live (``publish_home``, ``home_board``)
    #: for slots below it, and between commands the master may use them there
    #: (the communicator's :class:`~synkhronos.collectives.shm_plans.InlinePlan`).
    home_slots: int = 0

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every process has entered the barrier."""

    @abc.abstractmethod
    def broadcast(self, arrays: Sequence[np.ndarray] | None, root: int, failed: bool = False,
                  receive=None) -> list[np.ndarray]:
        """Root's arrays, returned in every process; ``receive(i, array)``, when
        given, makes what a non-root process keeps of array ``i``."""

    @abc.abstractmethod
    def reduce(self, arrays, op: str, root: int, weight: float = 1.0, failed: bool = False):
        """Combine every process's arrays with ``op``; the result on root, None elsewhere."""

    @abc.abstractmethod
    def all_reduce(self, arrays, op: str, weight: float = 1.0, failed: bool = False, in_place=False):
        """Combine every process's arrays with ``op``; the result everywhere
        (``in_place``: also written into resident arrays, where supported; a
        list of booleans says it per array: whether that array may be written)."""

    @abc.abstractmethod
    def gather(self, arrays, root: int, failed: bool = False, join=None):
        """On root, for each array, the list of every process's copy, or
        ``join(i, parts)`` of it (None elsewhere)."""

    @abc.abstractmethod
    def all_gather(self, arrays, failed: bool = False, join=None):
        """Everywhere, for each array, the list of every process's copy, or ``join(i, parts)`` of it."""

    def reset(self) -> None:
        """In the master, every process idle, after an abandoned command: forget
        its traces (default: nothing to forget)."""

    def local_reset(self) -> None:
        """In every process, after the master's :meth:`reset` (default: nothing)."""

    def resident(self, key: str, dtype, shape, fresh: bool = False) -> np.ndarray:
        """An array of this process that collectives read in place (``supports_resident`` only)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no resident arrays")

    def existing(self, key: str, dtype, shape) -> np.ndarray | None:
        """The resident array ``key`` of this dtype and shape, if there is one."""
        return None

    def drop_resident(self, key: str) -> None:
        """Give up resident array ``key`` (nothing to give up by default)."""

    def resident_ranges(self) -> list:
        """Byte ranges of this process's resident arrays (none by default)."""
        return []

    def where(self, rank: int) -> tuple[int, int]:
        """``(node, local rank)`` of global ``rank`` (one node by default)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be 0 to {self.size - 1}, got {rank!r}")
        return 0, rank

    # -- the home board (``home_slots`` > 0 only) ---------------------------

    def publish_home(self, slot: int, view) -> int:
        """Publish resident array ``view`` of this process under ``slot``; its generation (0: none)."""
        raise NotImplementedError(f"{type(self).__name__} has no home board (home_slots is 0)")

    def home_board(self, rank: int) -> memoryview:
        """``rank``'s home board: per slot, the generation published there (0: none)."""
        raise NotImplementedError(f"{type(self).__name__} has no home board (home_slots is 0)")

    # (the inline channel of small collectives within one fork, and the master's reads of
    # the others' homes, are the plans' own: ``plan(..., reducers=...)``)

    def plan(self, kind: str, layout, op, step=None, reducers=None, weight: float = 1.0) -> CommPlan | None:
        """A :class:`CommPlan` for ``kind`` collectives of this ``layout``
        (per array ``(dtype, shape)``) and ``op``, or None (the default): no fast
        path here, every call takes the full path. ``step``: across nodes, the
        step's key and words, as ``begin_step`` numbers and checks them.
        Without ``reducers``: asked only in a process that has the fork to itself (no
        workers), right after a full-path ``kind`` on values of this layout went through.
        With ``reducers`` (the process's kept Reducers, ``proc.kept.reducers``): the
        plan of a small collective of a fork with workers (``within_fork`` only:
        :class:`~synkhronos.collectives.shm_plans.InlinePlan`), asked in every process.
        ``"reduce"``: a planned call's output reduction (``op``: one op per array),
        ``weight`` this process's in an ``avg``."""
        return None

    def close(self) -> None:
        """Release what this process holds of the communicator."""

    # -- steps among nodes (across nodes, in a node master; no-ops on one node) --

    def node_table(self) -> tuple[int, list[int]] | None:
        """``(this process's node, every node's number of processes)`` across nodes;
        None on one node."""
        return None

    def among_nodes(self) -> Communicator | None:
        """In a node master, the communicator among the node masters (its rank is the
        node's index); None in every other process and on one node."""
        return None

    def begin_step(self, key, words, command: bool = False) -> None:
        """This node starts its next step among nodes: its number and ``key`` (what
        must be the same on every node) travel with each of its exchanges; ``words``
        (a string, or a function and its arguments) name it when steps differ.
        ``command``: the step of a command, which a step that came with its values
        (:meth:`values_begun`) stands for."""

    def values_begun(self) -> None:
        """The step just made (with the values of a command) is the next command's own."""

    def steps_begun(self) -> int | None:
        """How many steps among nodes this node master has begun (None: it makes none)."""
        return None

    def fail_step(self, what: str, reason: str | list, begun: bool) -> None:
        """This node's step failed before the others heard of it: make its first exchange
        all the same, flagging the failure, so that every node raises in that step
        (``begun``: whether the step was numbered already). ``reason``: what failed, or
        the local ranks whose shares of a call failed (named as the full path names them)."""

    @property
    def inline_outputs(self) -> bool:
        """A call's outputs may skip this communicator and ride back with the workers'
        answers (see ``within_fork``); across nodes the node master then finishes
        their reduction among the nodes with :meth:`reduce_node_part`."""
        return self.within_fork and not self.device_arrays

    def reduce_node_part(self, part, op: str, weight: float = 1.0, failed=False):
        """Across nodes, in a node master whose node's arrays were combined without this
        communicator (a call's outputs that rode the workers' answers, combined as the
        node's own reduce would): the exchange among the nodes of :meth:`reduce`, with
        ``part`` the node's result (None: nothing to add) and ``weight`` its weight in an
        ``avg`` (its contributing processes' together); every node's result."""
        raise NotImplementedError(f"{type(self).__name__} has no nodes to reduce among")

    def gather_node_part(self, parts, failed=False, join=None):
        """Across nodes, in a node master whose node's arrays were gathered without this
        communicator (a call's outputs that rode the workers' answers): the exchange
        among the nodes of :meth:`gather`, with ``parts``, per array, the list over this
        node's processes of its part (None where absent); per array, the list over every
        process of every node of its part, or ``join(i, parts)``, in every node master."""
        raise NotImplementedError(f"{type(self).__name__} has no nodes to gather among")

    def nodes_joined(self) -> list:
        """The nodes that had joined (``synk.join()``) at the last exchange among nodes."""
        return []

    def join(self) -> int:
        """This node has no steps of its own left: take part in the others' with nothing
        to add until every node has joined; the node that joined last (0 on one node)."""
        return 0

    def leave(self, reason: str) -> None:
        """This node can make no more steps (its fork broke at a step's end): tell the others."""

    def abandon(self, reason: str) -> bool:
        """Abandon the steps among nodes and tell the other nodes ``reason``; whether this
        call abandoned them (False: on one node, or abandoned already)."""
        return False

    def broken_among_nodes(self) -> bool:
        """Whether the steps among nodes were abandoned after a failure."""
        return False

    def waiting_among_nodes(self) -> str | None:
        """What this node master is waiting for the other nodes in, if it is."""
        return None
