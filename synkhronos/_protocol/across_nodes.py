"""Several nodes: the same script on many machines under ``mpirun`` or ``srun``.

Each launched copy of the script is the master of its node. ``synk.fork()``
forks the node's workers as on one machine (:func:`launched` tells it that
a launcher started it), and only then initialises MPI (``mpi4py.rc.initialize
= False``, then ``MPI.Init_thread``: many MPI transports break in a process
that forks after ``MPI_Init``) and joins the other nodes' masters
(:func:`join`). Every process's communicator becomes a
:class:`~synkhronos.collectives.hier.NodeCommunicator` over every process
of every node, so function outputs and shared-variable collectives span
the nodes with no change to the code that runs them. Workers never touch
MPI. Without a launcher nothing here runs and mpi4py is never imported.

Also here: the check that every node distributes the same functions
(:func:`check_same_functions`) and the values of node 0 for the collectives
that take values (:func:`from_first_node`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pickle
import sys
import time
import warnings
import zlib

import numpy as np

from .. import _state as state
from .._procs import launch
from .._procs.launch import LAUNCHER_VARS, launched
from .._batching import split
from ..errors import SynkError, SynkTimeoutError
from .session import is_timeout
from ..collectives import BACKENDS
from ..collectives.hier import NodeCommunicator

__all__ = ["launched", "connect", "connect_worker", "check_same_functions",
           "from_first_node", "share_host_cores", "warn_if_mpi_started", "abandon_at_exit", "note_failure", "LAUNCHER_VARS"]

#: Seconds a node whose node communicator was abandoned waits at exit before
#: it aborts the MPI job (the other nodes raise and close meanwhile).
ABORT_GRACE = 5.0


#: (copies on this host, this copy's index among them) as launchers tell it.
HOST_VARS = (("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
             ("MPI_LOCALNRANKS", "MPI_LOCALRANKID"), ("SLURM_NTASKS_PER_NODE", "SLURM_LOCALID"))


def share_host_cores() -> None:
    """Under a launcher that started several copies on this host without
    binding them (``--bind-to none``): keep this copy to its own block of the
    cores, as ``--bind-to`` would, so that the copies' workers, threads and
    pinning do not pile onto the same cores. A copy the launcher bound (its
    affinity is less than every core) is left as it is."""
    for size_var, rank_var in HOST_VARS:
        size_text, rank_text = os.environ.get(size_var, ""), os.environ.get(rank_var, "")
        if size_text.isdigit() and rank_text.isdigit():
            break
    else:
        return
    size, rank = int(size_text), int(rank_text)
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return
    if size <= 1 or not 0 <= rank < size or len(cores) < size or len(cores) < (os.cpu_count() or 0):
        return
    lo, hi = split(len(cores), size, rank)
    os.sched_setaffinity(0, cores[lo:hi])


def warn_if_mpi_started() -> None:
    """Before forking under a launcher: warn when the script already started
    MPI (``from mpi4py import MPI`` initialises it at import), since the
    workers are then forked after ``MPI_Init``."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        warnings.warn("MPI was initialised before synk.fork() (an import of mpi4py.MPI does that): "
                      "the workers are forked after MPI_Init, which some MPI transports do not "
                      "support; import mpi4py.MPI after synk.fork(), or set mpi4py.rc.initialize = "
                      "False before importing it", stacklevel=3)


def _mpi(timeout=None, check=None):
    """mpi4py's MPI, initialised now (after the fork; see :func:`.._procs.launch.mpi` for
    ``timeout`` and ``check``), finalised at exit."""
    MPI = launch.mpi(timeout, check)
    if not state.mpi_finalize_registered and launch.mpi_started_here():
        state.mpi_finalize_registered = True
        atexit.register(_finalize, MPI)  # finalised after close() at exit
    return MPI


def _finalize(MPI) -> None:
    """At exit, once every fork closed: ``MPI_Finalize`` (nothing is outstanding:
    close() freed the communicators), unless a failure left a collective
    abandoned, which Finalize could wait for forever: then the job is aborted."""
    if MPI.Is_finalized():
        return
    if state.nodes_broken or state.mpi_pending_dup is not None:
        # the other nodes got this node's failure notice (or sent theirs): give
        # them time to raise and close their forks before the job is stopped
        time.sleep(ABORT_GRACE)
        MPI.COMM_WORLD.Abort(1)
    MPI.Finalize()


def connect(proc, check) -> None:
    """In the node master, right after its workers were forked: start MPI, join
    the other nodes' masters and make ``proc.comm`` the communicator over every
    process of every node (the workers wait for it in :func:`connect_worker`)."""
    plan = getattr(proc.device, "plan", None)
    if plan is not None and getattr(plan, "nccl", False):
        # NCCL over every GPU of every node is designed (docs: Several machines),
        # not built: across nodes a GPU fork reduces through the host path
        warnings.warn("synkhronos: across nodes, GPU outputs and collectives go through the CPU "
                      "path (NCCL across nodes is not supported yet)", stacklevel=2)
        plan.nccl = False
    s = state.current()
    timeout = None if s is None else s.timeout
    try:
        MPI = _mpi(timeout, None if s is None else s.watch.poll)
    except TimeoutError:
        raise SynkTimeoutError(
            f"fork(): MPI did not start within timeout={timeout} s: MPI_Init returns once every copy "
            "of the script under the launcher has called it, and some have not (still loading their "
            "data before synk.fork(), failed before it, or never call it). This node's fork was "
            "closed; synk.fork() again waits for them again", [], timeout) from None
    try:
        inter = BACKENDS["mpi"](MPI.COMM_WORLD, master_rank=0, check=check)
    except BaseException as err:
        if not is_timeout(err):
            raise
        raise SynkTimeoutError(
            f"fork(): the other nodes did not join this one within timeout={timeout} s (MPI started, "
            "but some copies of the script have not reached synk.fork()'s exchange among the nodes: "
            "still busy before it, or failed). This node's fork was closed; synk.fork() again "
            "waits for them again (it meets what this try began)", [], timeout) from None
    try:
        with _between_commands(inter, proc.comm):  # the node table goes to the workers too
            proc.comm = NodeCommunicator(proc.comm, inter)
    except BaseException:
        state.nodes_broken = state.nodes_broken or inter.broken is not None
        inter.close()
        raise


def connect_worker(proc) -> None:
    """In a worker of a node, after opening its node's communicator: the
    communicator over every node (made with the master's :func:`connect`)."""
    proc.comm = NodeCommunicator(proc.comm, None)


def note_failure(proc) -> None:
    """At close(), before the communicators close: remember whether the node
    communicator was abandoned in a failure (MPI is then aborted at exit
    rather than finalised); its closing barrier waits outside any command."""
    inter = inter_comm(proc)
    if inter is None:
        return
    if proc.comm.broken_among_nodes():
        state.nodes_broken = True
    inter.check = liveness(inter.check)


def liveness(check):
    """The check of a wait among node masters outside a command: only whether
    this node's workers live (the command's deadline and slow-wait warning
    belong to commands)."""
    s = state.current()
    return check if s is None else s.watch.poll


@contextlib.contextmanager
def _between_commands(*comms):
    saved = [c.check for c in comms]
    for c, check in zip(comms, saved):
        c.check = liveness(check)
    try:
        yield
    finally:
        for c, check in zip(comms, saved):
            c.check = check


def inter_comm(proc):
    """The communicator among node masters (in a node master across nodes), else None."""
    comm = proc.comm
    return None if comm is None else comm.among_nodes()


def check_same_functions(proc, entries) -> None:
    """distribute() across nodes: every node must distribute the same functions.

    ``entries()`` gives this node's ``(name, digest of the graph)`` per
    function about to be distributed, in creation order (called only across
    nodes). Every node raises the same
    ValueError naming the first difference (count, then name and graph).
    Nothing happens on one node.
    """
    inter = inter_comm(proc)
    if inter is None:
        return
    proc.comm.begin_step(("distribute",), "distribute()")
    error = None
    mine: list | str  # this node's entries, or what went wrong
    try:
        mine = list(entries())
    except Exception as err:  # noqa: BLE001 - the others must hear of it, not wait
        error, mine = err, f"{type(err).__name__}: {err}"
    blob = np.frombuffer(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    with _between_commands(inter):
        got = inter.all_gather([blob])[0]
    if error is not None:
        raise error
    # a node that has joined (synk.join()) distributes nothing: it is left out
    lists = {node: pickle.loads(np.asarray(b).tobytes()) for node, b in enumerate(got) if b is not None}
    for node, entry in lists.items():
        if isinstance(entry, str):
            raise SynkError(f"distribute(): node {node} could not describe its functions: {entry}")
    (node0, first), *rest = lists.items()
    for node, mine in rest:
        if len(mine) != len(first):
            raise ValueError(f"distribute(): node {node0} built {len(first)} new function(s) "
                             f"{[e[0] for e in first]} but node {node} built {len(mine)} "
                             f"{[e[0] for e in mine]}; every node's script must build the same "
                             "functions in the same order")
        for k, ((name0, *d0), (name, *d)) in enumerate(zip(first, mine)):
            for part, a, b in zip(("a different graph", "different output ops", "different inputs "
                                   "broadcast (bcast_inputs)"), d0, d):
                if a != b:
                    raise ValueError(f"distribute(): function #{k} differs between nodes: node {node0} "
                                     f"built {name0!r}, node {node} built {name!r} with {part}; every "
                                     "node's script must build the same functions in the same order")


def begin_step(proc, cmd, wire) -> None:
    """The node master starts a command: what must be the same on every node (the kind
    of command, the function and output subset of a call, the kind, variables, op and
    rank of a collective) goes with every exchange among node masters until the next
    (:meth:`.collectives.mpi.MpiCommunicator.begin`). A command whose step began with
    its values (:func:`from_first_node`) begins none of its own."""
    comm = proc.comm
    if comm.among_nodes() is not None:
        kind = cmd.name.lower()
        comm.begin_step(step_key(kind, wire, proc), (step_words, proc, kind, wire), command=True)


def step_key(kind: str, wire, proc=None) -> tuple:
    """What of a command must be the same on every node (see :func:`begin_step`). A call
    names its function by what it is (:func:`function_identity`), never by this
    process's id for it, which differs between nodes whenever one built (or failed to
    build) a function the others did not."""
    if kind == "call" and isinstance(wire, tuple) and len(wire) == 8:
        lf = None if proc is None else proc.functions.get(wire[0])
        ident = getattr(lf, "node_identity", None) or wire[0]
        return ("call", ident, wire[5])  # the function, the output subset
    if kind == "collective" and isinstance(wire, tuple) and len(wire) == 9 and isinstance(wire[0], str):
        return (wire[0], tuple(wire[1]), wire[2], wire[3], wire[6], wire[7])  # kind, sids, op, rank, ...
    return (kind,)


def function_identity(proc, spec, graph_digest) -> tuple | None:
    """Across nodes: a function's identity, the same on every node that built it, whatever
    else each built or failed to build: a digest of its compiled graph (``graph_digest()``),
    output ops and broadcast inputs, and how many functions with that digest this fork
    built before it. None on one node (nothing compares it)."""
    if proc.comm.node_table() is None:
        return None
    digest = zlib.crc32(repr((graph_digest(), spec.output_modes or spec.output_ops,
                              tuple(spec.bcast))).encode())
    seen = proc.function_digests
    seen[digest] = seen.get(digest, -1) + 1
    return (digest, seen[digest])


def steps_begun(proc):
    """Across nodes, in a node master: how many steps it has begun (compare it after a
    failure with :func:`failed_step`); None elsewhere."""
    comm = proc.comm
    return None if comm is None else comm.steps_begun()


def failed_step(s, before, what: str, err: BaseException) -> None:
    """A public call or collective raised ``err`` in this node master (session ``s``): if
    its step never reached the others (it failed before its first exchange, maybe before
    it was even numbered), tell them in that step, so that every node raises there and
    the next step agrees (:meth:`.collectives.mpi.MpiCommunicator.fail_step`).
    ``before``: :func:`steps_begun` when the call started. Not for a call refused
    inside a running command (a signal handler's): that command's step is not its own."""
    comm = s.proc.comm
    if comm is None or before is None or not isinstance(err, Exception) or s.in_flight is not None:
        return
    begun = comm.steps_begun()
    if begun is None:
        return
    # (a call whose shares failed in this node names their ranks, as the full path's exchange does)
    reason = getattr(err, "synk_failed_ranks", None) or f"{type(err).__name__}: {err}"[:200]
    try:
        s.step_alone(what, comm.fail_step, what, reason, begun != before)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - a timeout or close() meanwhile: the others were told; ours is the error
        pass


def stepped(what: str):
    """Decorate a public collective: across nodes a failure of its own checks still takes
    its step on every node (:func:`failed_step`)."""
    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            s = state.current()
            comm = None if s is None else s.proc.comm  # (steps_begun, inline: this runs at every step)
            before = None if comm is None else comm.steps_begun()
            try:
                return fn(*args, **kwargs)
            except Exception as err:
                if before is not None and s is not None and os.getpid() == s.pid:  # (never in a child the user forked)
                    failed_step(s, before, what, err)
                raise
        return wrapper
    return wrap


def batch_key(batch):
    """What of a ``batch`` argument the nodes compare: itself when small, else a checksum."""
    if batch is None or isinstance(batch, (int, np.integer, slice)):
        return repr(batch)
    arr = np.asarray(batch)
    if arr.dtype.hasobject:
        return repr(batch)[:200]
    return (str(arr.dtype), arr.shape, zlib.crc32(np.ascontiguousarray(arr).tobytes()))


def step_words(proc, kind: str, wire) -> str:
    """A command in words, for :class:`~synkhronos.errors.StepMismatchError`."""
    key = step_key(kind, wire)
    if key[0] == "call":
        fn = proc.functions.get(key[1])
        name = fn.spec.name if fn is not None else f"#{key[1]}"
        return f"call {name}" + (f" (outputs {list(key[2])})" if key[2] else "")
    if len(key) == 6:
        what, sids, op, rank = key[:4]
        names = ", ".join(getattr(proc.shareds.get(sid), "name", None) or f"#{sid}" for sid in sids)
        extra = "".join(f", {k}={v!r}" for k, v in (("op", op), ("rank", rank)) if v is not None)
        return f"{what}([{names}]{extra})"
    return f"{kind}()"


def from_first_node(proc, make, what: str, sids, rank=None, batch=None, comm_size=None):
    """The values of a collective that takes values (scatter, set_value): node
    0's master computes them with ``make()`` and sends them to every other
    node's master, where ``make`` is not called (the script may pass None
    there). On one node: ``make()``. An error in ``make()`` on node 0 raises
    there and makes every other node raise ``PeerFailed`` naming it.

    Across nodes this exchange is the first of the collective's step, whose key
    holds ``batch`` too (so every node cuts the same rows, or every node raises
    StepMismatchError); the command that follows takes no step of its own. While
    a node has joined (``synk.join()``), a scatter (its rows would be lost) and a
    set_value of a rank of that node raise ValueError on every node taking part."""
    inter = inter_comm(proc)
    if inter is None:
        return make()
    wire = (what, sids, None, rank, None, None, True, 1, False)
    proc.comm.begin_step(("values", batch_key(batch)) + step_key("collective", wire),
                         (step_words, proc, "collective", wire))
    with _between_commands(inter):
        if inter.rank != 0:
            arrays = inter.broadcast(None, 0, what=what)
        else:
            try:
                arrays = [np.asarray(a) for a in make()]
            except Exception as err:
                try:
                    inter.broadcast(None, 0, failed=f"{type(err).__name__}: {err}"[:200], what=what)
                except Exception:  # noqa: BLE001 - the PeerFailed of our own flag: ours is the error
                    pass
                raise
            arrays = inter.broadcast(arrays, 0, what=what)
    joined = proc.comm.nodes_joined()  # (the same on every node: the exchange just made said so)
    if joined and what == "scatter":
        raise ValueError(f"scatter: node(s) {joined} have joined (synk.join()): their processes take "
                         "no rows, which would be lost; scatter once every node takes part again "
                         "(after join() returns), or set_value the rows of the others")
    if joined and rank is not None:
        node = proc.comm.where(rank)[0]
        if node in joined:
            raise ValueError(f"set_value: rank {rank} is a process of node {node}, which has joined "
                             "(synk.join()): it takes no part until every node has joined")
    proc.comm.values_begun()  # the command's step is this one
    return arrays


def joined_rank(proc, rank: int, what: str) -> None:
    """ValueError naming the join when global ``rank`` is a process of a node that has
    joined (known from the exchange just made; the same on every node)."""
    joined = proc.comm.nodes_joined()
    if joined:
        node = proc.comm.where(rank)[0]
        if node in joined:
            raise ValueError(f"{what}: rank {rank} is a process of node {node}, which has joined "
                             "(synk.join()): it takes no part until every node has joined")


def broke(proc, err: BaseException) -> None:
    """This node's fork broke (a worker died) at the end of a step: its last header
    tells the other nodes, whose next (or current) exchange raises NodeFailedError
    naming it (:meth:`.collectives.mpi.MpiCommunicator.leave`)."""
    proc.comm.leave(f"{type(err).__name__}: {err}")


def _abandon(proc, reason) -> None:
    """Abandon the communicator among the node masters, telling the others ``reason(node)``."""
    comm = proc.comm
    table = None if comm is None else comm.node_table()
    if table is not None and comm.abandon(reason(table[0])[:500]):
        state.nodes_broken = True


def abandon_at_exit(proc) -> None:
    """At exit with an uncaught exception in a node master's script: tell the
    other nodes (they raise ``NodeFailedError`` naming this node within one
    poll, instead of waiting for it in their next collective), and leave
    the node communicator abandoned, so close() does not wait for them."""
    err = getattr(sys, "last_value", None)
    if err is not None:
        _abandon(proc, lambda node: f"node {node}'s script ended with an uncaught {type(err).__name__}: {err}")
