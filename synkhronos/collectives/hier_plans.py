"""The hierarchical communicator's plan of a small all_reduce in a node of several processes.

Across nodes, the full path of a small ``synk.all_reduce`` is a command to the
node's workers and three steps (:mod:`.hier`): the node's processes reduce
into the node master through the shared-memory slots and a barrier, the node
masters make one MPI exchange, the node master broadcasts the result back
through the slots. Between commands the workers of a fork change no value,
so the node master can do the node's two steps itself, as the master of one
fork does its whole collective (:class:`.shm_plans.PeerHomes`): it reads every
process's value where it lives (the workers published their homes on the
home board after the full path), reduces them in rank order with the
Reducer the shared-memory communicator's reduce uses, makes the node
masters' exchange through the inter-node communicator's kept
:class:`.mpi_plans.StepPlan` (the full path's header with the node's weight,
numbered first; every node's head compared byte for byte, read long where
they differ), and writes the result into every process's home. The same
bits as the full path, in every process of every node; no command, no slot,
no barrier. When it may run (the fork idle, every worker's values where
they were) is the kept plans' rule, :mod:`synkhronos._kept.plans`.
"""

from __future__ import annotations

import numpy as np

from .base import CommPlan

__all__ = ["NodePlan", "NodeHomes"]


class NodePlan(CommPlan):
    """A node master's plan of a small all_reduce of ``layout`` with ``op`` in a node
    of several processes (see above): the node's shared-memory plan (``local``,
    an :class:`.shm_plans.InlinePlan`: its Reducers and its home boards) and the
    node masters' exchange (``step``, a :class:`.mpi_plans.StepPlan` made with
    the node's weight, as the full path's). It runs only directly, from the homes
    :meth:`find_peers` found; :meth:`run` never runs a command's half."""

    __slots__ = ("local", "step", "layout")

    @classmethod
    def make(cls, local, inter, layout, op: str, step, reducers):
        """The plan, or None where the node's values or the exchange cannot be
        planned (values that do not fit the inline areas or the header slot, an
        ``avg`` of integers, an op MPI does not plan). ``local``: the node's
        communicator; ``inter``: the node masters'."""
        local_plan = local.plan("all_reduce", layout, op, reducers=reducers)
        if local_plan is None or not hasattr(local_plan, "find_peers") or local_plan.casts is None \
                or any(local_plan.casts):
            return None
        # the node's weight among nodes, as the full path's first step gives it: in an avg
        # the sum of its processes' weights (1.0 each for a shared variable), else 1.0
        weight = float(local.size) if op == "avg" else 1.0
        step_plan = inter.plan("all_reduce", layout, op, step, weight=weight)
        if step_plan is None or step_plan.out_of_place:
            return None
        return cls(local_plan, step_plan, tuple(layout))

    def __init__(self, local, step, layout):
        self.local, self.step, self.layout = local, step, layout
        self.fingerprint = step.fingerprint

    def run(self, values, outs=None) -> bool:
        """Never the half of a command: the full path runs those (False)."""
        return False

    def find_peers(self, slots, own, peer_layouts=None) -> NodeHomes | None:
        """The node's every process's values of ``slots``, found on their home boards
        (:meth:`.shm_plans.InlinePlan.find_peers`); None when some worker published none."""
        peers = self.local.find_peers(slots, own, peer_layouts)
        return None if peers is None else NodeHomes(self, peers)


class NodeHomes:
    """Every process's values of one node's plan, where they live (a
    :class:`.shm_plans.PeerHomes`), and the node masters' exchange."""

    __slots__ = ("plan", "peers")

    def __init__(self, plan: NodePlan, peers):
        self.plan, self.peers = plan, peers

    def hold(self) -> bool:
        """Whether every worker's board still shows the homes found."""
        return self.peers.hold()

    def all_reduce(self) -> bool:
        """The node's values reduced in rank order, then among the node masters (a
        numbered step), then written into every process's home; False, having done
        nothing another process can see, when the exchange refused the values.
        Raises as the full path would when another node's step does not agree."""
        plan, peers = self.plan, self.peers
        reducers = plan.local.reducers
        # the node's part: new memory of the layout's very dtypes (the exchange checks them)
        part = [np.array(reducer.run(parts), dtype=dtype, copy=True)
                for reducer, parts, (dtype, _) in zip(reducers, peers.parts, plan.layout)]
        if not plan.step.run(part):
            return False
        for home, value in zip(peers.own, part):
            np.copyto(home, value)
        peers.broadcast(part)
        return True
