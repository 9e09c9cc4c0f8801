"""The same script on several nodes under ``mpirun``: synk.fork() on each,
MPI among the node masters (real ``mpirun -np 2`` and ``-np 3`` jobs on
this machine, each node forking 1 or 2 processes).

Each job runs tests/mpi/nodes_script.py, whose node masters check their
results against numpy on the nodes' rows joined in node order and write a
verdict; here the exit status, every node's verdict and what each node left
in /dev/shm (nothing) are checked. Jobs group many checks, since each one
pays PyTensor's compile (FAST_COMPILE) on every node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_mpi_comm import HERE, assert_all_ok, mpirun, needs_mpi

TCP = ("--mca", "pml", "ob1", "--mca", "btl", "self,tcp")


def _no_shm_left(out: Path, n: int) -> None:
    for node in range(n):
        left = (out / f"shm.{node}.txt").read_text()
        assert left == "", f"node {node} left shared memory: {left}"


@needs_mpi
def test_two_nodes_one_and_two_processes(tmp_path):
    """np 2, nodes of 1 and 2 processes, over shared memory: identity and
    sharding; every output op with uneven rows per node and per process and
    a node with no rows; every collective and set_value/get_value with
    global ranks (node 0's values, None elsewhere); a worker of node 1
    raising (node 1 raises its error, node 0 PeerFailed naming node 1's rank;
    the next call works everywhere); the distribute() error when node 1 built
    a different graph."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "ops", "1,2")
    assert_all_ok(rc, output, verdicts, 2)
    _no_shm_left(tmp_path, 2)
    # two unbound copies on this machine: each kept to its own block of the cores
    before = verdicts[0]["affinity_before"]
    if len(before) >= 2 and len(before) >= (os.cpu_count() or 0):
        mine = [set(verdicts[r]["affinity"]) for r in (0, 1)]
        assert not mine[0] & mine[1] and mine[0] | mine[1] == set(before), mine


@needs_mpi
def test_three_nodes_over_tcp(tmp_path):
    """np 3 (2, 1 and 2 processes), MPI forced over TCP: the same checks, and
    the distribute() error when node 1 built more functions than node 0."""
    rc, output, verdicts = mpirun(tmp_path, 3, "nodes_script.py", "ops", "2,1", extra=TCP)
    assert_all_ok(rc, output, verdicts, 3)
    _no_shm_left(tmp_path, 3)


@needs_mpi
def test_worker_killed_on_node_one(tmp_path):
    """A worker of node 1 killed with SIGKILL: node 1's next call raises
    WorkerDiedError naming its rank, node 0's the NodeFailedError of a node that left,
    naming node 1 and that rank (node 1 leaves in that step: its outputs ride its
    workers' answers, so no exchange of the step is made before its fork broke), both
    within seconds; close() is clean, nothing is left in /dev/shm on either node, and
    every node forks again and goes on."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "kill", "1,2")
    assert_all_ok(rc, output, verdicts, 2)
    assert "WorkerDiedError" in verdicts[1]["error"] and "rank 1" in verdicts[1]["error"]
    assert verdicts[0]["error"].startswith("NodeFailedError: node 1 ") and "rank 1 died" in verdicts[0]["error"]
    _no_shm_left(tmp_path, 2)


def _planned_somewhere(verdicts, sizes: str) -> None:
    """Every node of one process made steps on its kept MPI plan (a fast path that
    never ran would prove nothing). (A node of several processes may too: its master's
    small reductions among nodes run on kept exchanges, ``NodeCommunicator._kept_middle``.)"""
    per_node = [int(k) for k in sizes.split(",")]
    for node, v in verdicts.items():
        if per_node[node % len(per_node)] == 1:
            assert v["plan_steps"] > 0, (node, v["plan_steps"])


@needs_mpi
@pytest.mark.parametrize("n, sizes", [(2, "1,2"), pytest.param(2, "1,1", marks=pytest.mark.slow),
                                      pytest.param(3, "2,1", marks=pytest.mark.slow)],
                         ids=["np2", "np2-planned", "np3"])
def test_nodes_in_different_steps_raise_everywhere(tmp_path, n, sizes):
    """Node 1 calls g where the others call f, all_reduce against a call, another op,
    another variable, scatter against broadcast, set_value of another rank, one
    collective more, gather against all_gather: every node raises StepMismatchError
    naming every node's step (each went on silently before), and the next call works.
    Nodes of one process make their all_reduces on kept MPI plans ("1,1": both; "1,2":
    node 0 against node 1's full path); nodes of two here take the full path (a value set
    before each step), their direct plans meet divergences in
    test_divergence_on_a_node_masters_direct_plan."""
    rc, output, verdicts = mpirun(tmp_path, n, "nodes_script.py", "diverge", sizes)
    assert_all_ok(rc, output, verdicts, n)
    assert all(v["cases"] == 8 for v in verdicts.values())
    _planned_somewhere(verdicts, sizes)
    _no_shm_left(tmp_path, n)


@needs_mpi
@pytest.mark.parametrize("seed, sizes", [(4801, "1,1"), pytest.param(4802, "1,1", marks=pytest.mark.slow),
                                         pytest.param(4803, "1,1,1", marks=pytest.mark.slow)],
                         ids=["np2", "np2-seed2", "np3"])
def test_planned_all_reduce_bit_for_bit(tmp_path, seed, sizes):
    """Nodes of one process each: random all_reduce loops over random sets of variables
    (every op; float32, float64, int32, int64, uint8, bool, complex64; 0-d to (129,)),
    each node's values its own: on 2 nodes every result equals ops.combine of the nodes'
    values in node order, bit for bit, on both nodes, on the kept MPI plans (the header's
    and the large plan's ring) and on the full path (its ring too). On 3 nodes the same,
    except that a float sum, avg or prod too large for the header (Open MPI's
    ``Iallreduce`` there, in its own order) is close to combine's, and the same bits on
    every node."""
    n = len(sizes.split(","))
    rc, output, verdicts = mpirun(tmp_path, n, "nodes_script.py", f"planned:{seed}", sizes)
    assert_all_ok(rc, output, verdicts, n)
    assert all(v["checked"] > 150 for v in verdicts.values())
    assert all(v.get("large_plan_steps", 0) > 5 for v in verdicts.values()), verdicts  # (the large plan ran)
    digests = [v.get("digests", []) for v in verdicts.values()]
    assert all(d == digests[0] for d in digests) and (n == 2 or len(digests[0]) > 10), digests
    _planned_somewhere(verdicts, sizes)
    _no_shm_left(tmp_path, n)


@needs_mpi
@pytest.mark.parametrize("sizes", ["2,2", "1,2"], ids=["two-two", "mixed"])
def test_node_master_plans_all_reduce_of_its_node(tmp_path, sizes):
    """Nodes of several processes: random all_reduce loops over random sets of variables
    (every op; float32, float64, int32, int64, uint8, complex64; 0-d to (40,)), each node master's value of a
    variable new in a third of its steps, its workers' the last result. Every result equals the full path's
    hierarchy of ops.combine (each node's processes in rank order, then the nodes; an avg
    weighted by the nodes' sizes) bit for bit, in every process of every node (gathered
    every 8 steps); and most steps are made with no command, by the node master alone on
    its node's homes and the kept exchange among node masters ("1,2": beside a node of one
    process on its own kept plan)."""
    n = len(sizes.split(","))
    rc, output, verdicts = mpirun(tmp_path, n, "nodes_script.py", "node_planned:4911", sizes)
    assert_all_ok(rc, output, verdicts, n)
    assert all(v["checked"] > 200 for v in verdicts.values()), verdicts
    per_node = [int(k) for k in sizes.split(",")]
    for node, v in verdicts.items():
        if per_node[node % n] > 1:  # (the direct plan ran: a fast path that never ran proves nothing)
            assert v["direct"] > 15, (node, v["direct"])  # (34 of 160 steps with this seed)
            assert node == 0 or v["direct_avg"] >= 4, (node, v["direct_avg"])
    _no_shm_left(tmp_path, n)


@needs_mpi
@pytest.mark.parametrize("sizes", ["1,1", "1,2", "2,2"], ids=["alone", "mixed", "two-two"])
def test_planned_calls_across_nodes(tmp_path, sizes):
    """Random calls repeated with the same shapes (every op, float64, float32, int64, two
    outputs of one op, three ops; row counts equal on every node or not), on nodes of one process
    (``alone``: each keeps its output reduction, the MPI call plan), on a node of one
    process beside a node of two (``mixed``) and on two nodes of two (``two-two``): a node of
    two combines its processes' outputs as within one fork (they ride the workers' answers)
    and its master makes the same exchange through its own kept plan,
    ``NodeCommunicator._kept_middle``; a node on either path meets the others byte for byte:
    every result equals numpy's over every node's rows (gathered rows in node order), the same bits on every node; a
    node's share failing inside a planned call (its master's, then a worker's) raises on every
    node (its Assert there, PeerFailed naming it elsewhere) and the next call agrees again; the
    others are late for that step, so node 1 waits in it (its wait's check took its worker's
    failure flag, already told, for a failure during the exchange and abandoned the nodes)."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "planned_calls:4901", sizes)
    assert_all_ok(rc, output, verdicts, 2)
    digests = [v["digests"] for v in verdicts.values()]
    assert len(digests[0]) > 100 and all(d == digests[0] for d in digests), "the nodes' results differ in bits"
    # (a node of one process: its calls' kept reductions; of two: its master's kept exchanges)
    assert all(v["planned_calls"] > 40 for v in verdicts.values()), [v["planned_calls"] for v in verdicts.values()]
    # a node of two processes: its kept calls' outputs ride the workers' answers (one per function called)
    for node, size in enumerate(sizes.split(",")):
        assert (verdicts[node]["inline_plans"] >= 10) == (size == "2"), (node, verdicts[node]["inline_plans"])
        # (gathered outputs too: the node master gathers its processes' parts among the nodes)
        assert (verdicts[node]["inline_gathers"] >= 1) == (size == "2"), (node, verdicts[node]["inline_gathers"])
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_divergence_on_the_plan(tmp_path):
    """Once both nodes keep MPI plans, node 1 changes a variable's shape (ValueError on
    both), uses another op, skips a step (StepMismatchError on both), joins (node 0's
    steps on the plan reduce its own values): every node raises the same error, and the
    next call and all_reduce agree again."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "diverge_planned", "1,1")
    assert_all_ok(rc, output, verdicts, 2)
    assert all(v["cases"] == 4 for v in verdicts.values())
    _planned_somewhere(verdicts, "1,1")
    _no_shm_left(tmp_path, 2)


@needs_mpi
@pytest.mark.parametrize("sizes", ["2,2", "2,1"], ids=["two-two", "two-one"])
def test_divergence_on_a_node_masters_direct_plan(tmp_path, sizes):
    """Nodes of several processes whose masters make a small all_reduce alone (no command:
    the node's homes and the kept exchange): node 1 uses another op, skips the step (a
    call), changes the variable's shape, or calls join() while the others reduce on
    their direct plans: every node raises the same error (or reduces the others' values
    while joined), and the next call and all_reduce agree again."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "diverge_node_planned", sizes)
    assert_all_ok(rc, output, verdicts, 2)
    assert all(v["cases"] == 4 for v in verdicts.values())
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_divergence_on_kept_broadcast_and_reduce(tmp_path):
    """Nodes of one process keep plans of a small broadcast (node 0's values in its header)
    and reduce (an all-reduce among node masters): node 0 changes the variable's shape (every
    node gets it), node 1 its own copy's (it gets node 0's), node 1 skips the step,
    broadcasts another variable, all-reduces instead, reduces with another op, in place, or
    a value of another shape (StepMismatchError or ValueError on both), a node joins (node
    0's steps go on over its own values; node 1's broadcast from node 0 raises ValueError):
    every value is node 0's, or every node's combined, and the next steps agree."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "diverge_kept", "1,1")
    assert_all_ok(rc, output, verdicts, 2)
    assert all(v["cases"] == 10 for v in verdicts.values())
    _planned_somewhere(verdicts, "1,1")
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_one_process_node_failure_reaches_the_others(tmp_path):
    """Node 1 forks one process and its rows fail inside a call (sum, gather and max
    outputs): node 0 raises PeerFailed naming node 1 (it returned a result of its own
    rows only, 16 of 16 runs), node 1 its Assert; the next call works on both."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "alone", "2,1")
    assert_all_ok(rc, output, verdicts, 2)
    _no_shm_left(tmp_path, 2)


@needs_mpi
@pytest.mark.parametrize("n, sizes, seed",
                         [(2, "1,2", 35000), pytest.param(2, "1,1", 37000, marks=pytest.mark.slow),
                          pytest.param(3, "2,1", 36000, marks=pytest.mark.slow)],
                         ids=["np2", "np2-planned", "np3"])
def test_random_divergence(tmp_path, n, sizes, seed):
    """Random sequences of calls and collectives (two functions, all_reduce and reduce
    with every op, broadcast with and without values, gather, get_value, set_value of
    any global rank) drawn alike on every node; in 4 of 5 node 1 perturbs one step
    (another function, op, variable, kind or rank, a step skipped, a step more). Every
    perturbed sequence raises StepMismatchError on every node within seconds, every
    other step matches numpy exactly, and each node goes on. ``SYNK_DIVERGE_SEQUENCES``
    sets how many sequences (40 here; a few hundred were run once, see the notes)."""
    count = int(os.environ.get("SYNK_DIVERGE_SEQUENCES", "40"))
    rc, output, verdicts = mpirun(tmp_path, n, "nodes_script.py", f"random:{seed}:{count}", sizes,
                                  limit=max(120, count * 3))
    assert_all_ok(rc, output, verdicts, n)
    for node, v in verdicts.items():
        c = v["counts"]
        assert c["sequences"] == count and c["raised"] == c["perturbed"] > 0 and c["steps"] > count, (node, c)
    _planned_somewhere(verdicts, sizes)
    _no_shm_left(tmp_path, n)


@needs_mpi
@pytest.mark.parametrize("n, sizes, masters, steps, seed", [
    (2, "1,2", "0,1", 150, 4101),
    pytest.param(2, "2,2", "1,0", 600, 4102, marks=pytest.mark.long),
    pytest.param(3, "2,1,2", "1,0,0", 500, 4103, marks=pytest.mark.long),
    pytest.param(2, "1,1", "0,0", 600, 4104, marks=pytest.mark.long),
    pytest.param(4, "1,1,1,1", "0,0,0,0", 400, 4105, marks=pytest.mark.long)],
    ids=["mixed", "two-two", "three", "ones", "four"])
def test_model_across_nodes(tmp_path, n, sizes, masters, steps, seed):
    """tests/test_model.py's model-based random test across nodes (tests/mpi/model_nodes.py):
    every node draws the same random steps (calls with every option, every collective,
    set_value/get_value of global ranks, synk.data, late functions, a new fork, misuse,
    synk.join() of some nodes while the others step without them)
    and checks after each one every process's copy of every variable on every node and
    every returned value, bit for bit, against a model of the hierarchy docs/nodes.rst
    describes (each node's rows split among its processes, reductions by node then among
    nodes, node 0's values where a collective takes values; a node master given the
    master rank 1). ``SYNK_MODEL_SEED`` replaces the seed; make test-nodes runs the
    longer ones. Nothing is left in /dev/shm."""
    seed = int(os.environ.get("SYNK_MODEL_SEED", seed))
    rc, output, verdicts = mpirun(tmp_path, n, "model_nodes.py", sizes, masters, str(seed), str(steps),
                                  limit=max(240, steps))
    assert_all_ok(rc, output, verdicts, n)
    assert all(v["steps"] == steps for v in verdicts.values()), {r: v.get("steps") for r, v in verdicts.items()}
    _no_shm_left(tmp_path, n)


@needs_mpi
def test_avg_on_nodes_of_different_sizes(tmp_path):
    """np 3, nodes of 2, 1 and 2 processes: an avg all_reduce of 40 variables (too large for
    the header; each node's part scaled by its share before MPI's sum), 0-d ones among them,
    every process its own values: close to numpy's mean, the same bits on every node (the
    0-d parts were read by MPI after they were freed: wrong values everywhere, no error)."""
    rc, output, verdicts = mpirun(tmp_path, 3, "nodes_script.py", "avg_uneven", "2,1")
    assert_all_ok(rc, output, verdicts, 3)
    assert verdicts[0]["digests"] == verdicts[1]["digests"] == verdicts[2]["digests"]
    _no_shm_left(tmp_path, 3)


@needs_mpi
def test_reductions_fold_in_node_order_with_numpys_nan(tmp_path):
    """np 4, nodes of one process: reductions too large for the header (all_reduce and
    reduce of float32 and float64 variables with every op, a call's max, min and sum
    outputs) of values whose sum depends on the order, a NaN on node 1: numpy's fold in
    node order, bit for bit, the same on every node. (MPI's own reductions folded in
    another order, and their MAX and MIN dropped the NaN: a number, without an error.)"""
    rc, output, verdicts = mpirun(tmp_path, 4, "nodes_script.py", "fold_order", "1")
    assert_all_ok(rc, output, verdicts, 4)
    assert len({v["digest"] for v in verdicts.values()}) == 1, {r: v["digest"] for r, v in verdicts.items()}
    _no_shm_left(tmp_path, 4)


@needs_mpi
def test_bad_broadcast_value_on_node_zero(tmp_path):
    """A value of the wrong ndim given to broadcast() on node 0 (None elsewhere): node 0
    raises it, node 1 PeerFailed naming it within seconds (it waited for ever), in the
    same step: the next broadcast works on both."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "bad_broadcast", "1,2")
    assert verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]
    _no_shm_left(tmp_path, 2)


@needs_mpi
@pytest.mark.parametrize("sizes", ["1,2", pytest.param("2,2", marks=pytest.mark.long)])
def test_timeout_names_the_late_node(tmp_path, sizes):
    """fork(timeout=3): a node whose master waits for a late node raises SynkTimeoutError
    naming the other nodes, not its own healthy workers (or "ranks []"); the late node
    then raises NodeFailedError."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "timeout", sizes)
    assert verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_fork_timeout_bounds_the_mpi_start(tmp_path):
    """Node 1 is 5 s late to fork(): node 0's fork(timeout=2) raises SynkTimeoutError
    within seconds saying MPI did not start (it waited inside MPI_Init, deaf to the
    timeout and to signals), its fork closed with nothing left in /dev/shm; its next
    fork() waits for node 1, and then both call together."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "late_start", "1,2")
    assert_all_ok(rc, output, verdicts, 2)
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_node_failing_before_fork_leaves_nothing(tmp_path):
    """Node 1 fails before its fork(): mpirun stops node 0, which waits for MPI to start
    (it used to wait inside MPI_Init, where its SIGTERM handler could not run, and left
    7 to 11 names in /dev/shm): nothing of node 0's is left."""
    import time

    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "fail_before_fork", "2,1")
    assert rc != 0, output[-3000:]
    pid = (tmp_path / "pid.0.txt").read_text()
    time.sleep(1.0)  # node 0's workers unlink as they leave
    left = [n for n in os.listdir("/dev/shm") if n.startswith((f"synk.{pid}.", f"sem.synk.{pid}."))]
    assert left == [], f"node 0 (pid {pid}) left {left}:\n{output[-3000:]}"


@needs_mpi
def test_broken_node_tells_the_others_at_once(tmp_path):
    """A worker of node 1 is killed; node 1's call raises, then its script is busy for
    5 s: node 0's call of that step raises NodeFailedError naming node 1 and its failure
    within 2.5 s (it waited until node 1 acted again), its next call at once; every node
    closes and forks again, and MPI finalises cleanly (mpirun exits 0)."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "busy", "1,2")
    assert_all_ok(rc, output, verdicts, 2)
    _no_shm_left(tmp_path, 2)


@needs_mpi
@pytest.mark.parametrize("n, sizes", [(2, "1,2"), pytest.param(3, "2,1", marks=pytest.mark.slow)],
                         ids=["np2", "np3"])
def test_uneven_inputs_with_join(tmp_path, n, sizes):
    """Nodes with 2, 4 (and 1) batches, each calling synk.join() when its batches run out:
    every step's avg (flat over the rows passed), sum, max, min, gather, integer avg and
    reduce is numpy's over the nodes still passing rows; join() returns the last node to
    join on every node; then the nodes step together again. A broadcast of node 0's values
    while node 0 has joined raises ValueError naming it on every other node."""
    rc, output, verdicts = mpirun(tmp_path, n, "nodes_script.py", "uneven", sizes)
    assert_all_ok(rc, output, verdicts, n)
    _no_shm_left(tmp_path, n)


@needs_mpi
def test_join_while_the_others_close(tmp_path):
    """Node 1 joins; node 0 calls twice alone, then closes without joining: node 1's
    join() raises SynkError saying so; both close cleanly (mpirun exits 0)."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "join_close", "1,2")
    assert_all_ok(rc, output, verdicts, 2)
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_node_closes_while_the_others_call(tmp_path):
    """close() on node 1 while node 0 calls: node 0 raises naming node 1's close(),
    then NodeFailedError saying it closed; nothing hangs, nothing is left."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "leave", "1,2")
    assert verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]
    _no_shm_left(tmp_path, 2)


def test_without_launcher_one_node():
    """Without a launcher: world() is node 0 of 1 with the fork's own ranks,
    shard() is every row, and mpi4py is never imported."""
    code = """
import sys, synkhronos as synk
assert synk.fork(2, device="cpu") == 2
w = synk.world()
assert (w.node, w.nodes, w.rank, w.size, w.local_size, w.node_sizes) == (0, 1, 0, 2, 2, (2,)), w
assert synk.shard(7) == slice(0, 7), synk.shard(7)
synk.close()
sys.exit(3 if "mpi4py" in sys.modules else 0)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE.parent, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_world_and_shard_errors():
    import synkhronos as synk

    with pytest.raises(RuntimeError, match="fork"):
        synk.world()
    with pytest.raises(TypeError, match="n_rows"):
        synk.shard(2.5)
    with pytest.raises(ValueError, match="n_rows"):
        synk.shard(-1)


def _prefix_left(out: Path, n: int) -> list:
    prefixes = [(out / f"prefix.{node}.txt").read_text() for node in range(n)]
    return [name for name in os.listdir("/dev/shm") if any(name.startswith(p) for p in prefixes)]


@needs_mpi
def test_uncaught_error_on_node_one(tmp_path):
    """Node 1's script dies of an uncaught exception (no close()) while node 0
    calls: node 0's call raises NodeFailedError naming node 1 and its error
    within seconds (node 1's exit hook sends the notice), node 0 closes
    cleanly, then the job is aborted (a failure notice leaves MPI unfinishable);
    nothing is left in /dev/shm."""
    import time

    t0 = time.monotonic()
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "raise", "2,2")
    assert time.monotonic() - t0 < 60
    assert rc != 0
    assert verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]
    assert "NodeFailedError: node 1" in verdicts[0]["error"] and "on purpose" in verdicts[0]["error"]
    _no_shm_left(tmp_path, 1)
    assert _prefix_left(tmp_path, 2) == []


@needs_mpi
def test_node_master_killed(tmp_path):
    """Node 1's master killed with SIGKILL: mpirun stops the job within
    seconds (node 0's polling waits let its SIGTERM handler run), and neither
    node leaves anything in /dev/shm (node 1's workers clean up after their
    master)."""
    import time

    t0 = time.monotonic()
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "sigkill", "2,2")
    assert time.monotonic() - t0 < 60
    assert rc != 0 and "signal 9" in output, output[-3000:]
    time.sleep(1.0)  # node 1's orphaned workers unlink as they leave
    assert _prefix_left(tmp_path, 2) == []


def _final_numbers(out: str, epochs: int) -> list:
    line = [ln for ln in out.splitlines() if ln.startswith(f"2 proc  epoch {epochs:2d}")]
    assert len(line) == 1, out[-3000:]
    words = line[0].replace("%", "").split()
    return [float(words[i + 1]) for i, w in enumerate(words) if w in ("loss", "acc")]


@needs_mpi
@pytest.mark.long
def test_digits_demo_on_two_nodes(tmp_path):
    """The digits demo (synkhronos.extensions' Adam step) under ``mpirun -np 2``,
    one process per node, each node passing its shard of every minibatch,
    trains as one node of 2 processes does: the same losses and accuracy up
    to float32 rounding (make demo-mpi runs it for the full 20 epochs)."""
    import os

    from test_mpi_comm import MPIRUN

    demo = str(HERE.parent / "demos" / "train_digits.py")
    common = ["--epochs", "5", "--no-progress", "--no-baseline", "--results", str(tmp_path)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    two_nodes = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca",
                                "osc", "^ucx", sys.executable, demo, "--workers", "1", *common],
                               capture_output=True, text=True, timeout=300, env=env)
    assert two_nodes.returncode == 0, two_nodes.stdout[-3000:] + two_nodes.stderr[-3000:]
    assert "2 nodes, 2 processes in all" in two_nodes.stdout
    one_node = subprocess.run([sys.executable, demo, "--workers", "2", *common],
                              capture_output=True, text=True, timeout=300)
    assert one_node.returncode == 0, one_node.stdout[-3000:] + one_node.stderr[-3000:]
    assert _final_numbers(two_nodes.stdout, 5) == pytest.approx(_final_numbers(one_node.stdout, 5),
                                                                rel=0.05, abs=1e-3)


AGENT = """#!/bin/sh
# Open MPI's rsh agent: "host command..." -> the command in that host's network
# namespace, with a hostname (UTS namespace) and session directory of its own
host="$1"; shift
case "$host" in
  {ip_a}) ns={ns_a} ;;
  {ip_b}) ns={ns_b} ;;
  *) echo "unknown host $host" >&2; exit 1 ;;
esac
mkdir -p "{tmp}/$ns"
exec ip netns exec "$ns" unshare --uts /bin/sh -c \\
  "hostname $ns; export TMPDIR={tmp}/$ns PRTE_MCA_prte_tmpdir_base={tmp}/$ns; $*"
"""


def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@needs_mpi
def test_two_network_namespaces(tmp_path):
    """Two "machines" of the test's own making: network namespaces joined by a
    veth pair, each node in its own (and its own hostname), MPI over TCP
    between them (Open MPI starts node 1's daemon through an rsh agent that
    enters its namespace). The ops checks of 2 nodes of 2 processes pass.
    Skipped where namespaces cannot be made (not root, no ``ip``/``unshare``)."""
    import os
    import shutil

    from test_mpi_comm import JOB_LIMIT, MPIRUN

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("needs root, ip and unshare to make network namespaces")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"synk13a{tag}", f"synk13b{tag}"
    ip_a, ip_b = "10.213.0.1", "10.213.0.2"
    made = []
    try:
        for ns in (ns_a, ns_b):
            done = _sh("ip", "netns", "add", ns)
            if done.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {done.stderr.strip()}")
            made.append(ns)
        steps = [("ip", "link", "add", f"s13a{tag}", "type", "veth", "peer", "name", f"s13b{tag}"),
                 ("ip", "link", "set", f"s13a{tag}", "netns", ns_a),
                 ("ip", "link", "set", f"s13b{tag}", "netns", ns_b)]
        for ns, dev, ip in ((ns_a, f"s13a{tag}", ip_a), (ns_b, f"s13b{tag}", ip_b)):
            steps += [("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev),
                      ("ip", "-n", ns, "link", "set", dev, "up"), ("ip", "-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = _sh(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot connect the namespaces ({' '.join(step)}): {done.stderr.strip()}")
        agent = tmp_path / "agent.sh"
        agent.write_text(AGENT.format(ip_a=ip_a, ip_b=ip_b, ns_a=ns_a, ns_b=ns_b, tmp=tmp_path))
        agent.chmod(0o755)
        out = tmp_path / "out"
        out.mkdir()
        net = f"{ip_a.rsplit('.', 1)[0]}.0/24"
        cmd = ["ip", "netns", "exec", ns_a, str(MPIRUN), "-np", "2", "--host", f"{ip_a}:1,{ip_b}:1",
               "--mca", "plm_rsh_agent", str(agent), "--bind-to", "none", "--mca", "osc", "^ucx",
               "--mca", "pml", "ob1", "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", net,
               "--mca", "oob_tcp_if_include", net, "-x", "PYTHONPATH", "-x", "SYNK_MPI_TEST_LIMIT",
               sys.executable, str(HERE / "mpi" / "nodes_script.py"), str(out), "ops", "2,2"]
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   SYNK_MPI_TEST_LIMIT=str(JOB_LIMIT - 15),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_LIMIT, env=env)
        import json

        verdicts = {}
        for path in out.glob("verdict.*.json"):
            v = json.loads(path.read_text())
            verdicts[v["rank"]] = v
        assert_all_ok(done.returncode, done.stdout + done.stderr, verdicts, 2)
        # node 1 ran in the other namespace (started by the agent, with its hostname)
        assert verdicts[1]["hostname"] == ns_b and verdicts[0]["netns"] != verdicts[1]["netns"], verdicts
        _no_shm_left(out, 2)
    finally:
        for ns in made:
            _sh("ip", "netns", "del", ns)


@needs_mpi
def test_nodes_switched_off_under_mpirun(tmp_path):
    """SYNKHRONOS_NODES=0: every launched copy is a node of its own (one
    machine's fork, no MPI, mpi4py never imported)."""
    from test_mpi_comm import MPIRUN

    script = tmp_path / "alone.py"
    script.write_text("import sys, synkhronos as synk\n"
                      "synk.fork(1, device='cpu')\n"
                      "w = synk.world()\n"
                      "assert (w.node, w.nodes, w.size) == (0, 1, 1), w\n"
                      "synk.close()\n"
                      "sys.exit(3 if 'mpi4py' in sys.modules else 0)\n")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", SYNKHRONOS_NODES="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", "--mca", "osc", "^ucx",
                           "-x", "SYNKHRONOS_NODES", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


# -- steps that stay true after a user's own error, a join or a timeout -----------------------


@needs_mpi
@pytest.mark.parametrize("n, sizes", [(2, "1,2"), pytest.param(3, "2,1", marks=pytest.mark.long)],
                         ids=["np2", "np3"])
def test_caught_errors_keep_the_steps(tmp_path, n, sizes):
    """Node 1's call fails a local check (a bad batch) and a collective a bad op, caught by
    its script; it built a function that failed to compile; it makes one op-None call more;
    it calls a function of one output group where node 0 calls one of two: every node
    raises on that step (node 0's call used to return its step plus node 1's next, or
    raise for good afterwards), the next identical steps work, and join() names node 1
    when its last calls had op None only."""
    rc, output, verdicts = mpirun(tmp_path, n, "nodes_script.py", "caught", sizes)
    assert_all_ok(rc, output, verdicts, n)
    _no_shm_left(tmp_path, n)


@needs_mpi
def test_collectives_while_a_node_has_joined(tmp_path):
    """Node 1 joins: scatter refuses (it kept rows 0-3 of 8 and dropped the rest),
    set_value/get_value of node 1's rank raise ValueError naming the join, gather,
    all_gather, get_lengths and get_shapes leave node 1 out (they raised AttributeError,
    TypeError, IndexError); node 0 joined: broadcast, scatter and set_value each name
    their own operation."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "joined_collectives", "2,1")
    assert_all_ok(rc, output, verdicts, 2)
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_fork_timeout_then_fork_again(tmp_path):
    """Node 1 is 3 s late to make the communicator among the nodes: node 0's
    fork(timeout=0.5) raises SynkTimeoutError, its fork() again waits for node 1, whose
    fork(timeout=60) goes through (it raised the private _TimedOut after 3 s, with a
    "waited 3036 s" warning, and both retries hung), and both call together."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "fork_retry", "1,2")
    assert_all_ok(rc, output, verdicts, 2)
    _no_shm_left(tmp_path, 2)


@needs_mpi
def test_timeout_says_what_to_do(tmp_path):
    """fork(timeout=2), node 1 5 s late for a call: node 0's SynkTimeoutError said
    "synkhronos is usable", then its next call raised that the communicator was
    abandoned; now it says to close() and fork() again, which works on both nodes."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "timeout_usable", "1,2")
    # (mpirun's status is not checked: an abandoned exchange makes MPI abort the job at exit)
    assert sorted(verdicts) == [0, 1] and verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]
    _no_shm_left(tmp_path, 2)


@needs_mpi
@pytest.mark.parametrize("late", ["1", "0", "close"], ids=["node-1-late", "node-0-late", "close"])
def test_timeout_and_close_during_a_planned_all_reduce(tmp_path, late):
    """An all_reduce kept on every node (MPI plan on the node of one process, the master's
    direct plan on the node of two), a timeout of 2 s, one node 4 s late: the other raises
    SynkTimeoutError naming the other nodes (it raised the private _TimedOut, a
    BaseException), whichever node is late; a signal handler's close() during node 0's
    planned all_reduce raises SynkError and closes the fork (it stayed open)."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", f"timeout_planned:{late}", "1,2")
    # (mpirun's status is not checked: an abandoned exchange makes MPI abort the job at exit)
    assert sorted(verdicts) == [0, 1] and verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]
    _no_shm_left(tmp_path, 2)


@needs_mpi
@pytest.mark.long
def test_fork_again_after_exchanges_abandoned_on_each_node(tmp_path):
    """Node 0, then node 1, in turn six times, is late for a step (the other times out and
    abandons its exchange); every node closes and forks again each time: every fork() and its
    call work (one fork() hung in about half of such jobs, for good without a timeout: two
    outstanding Idups in Open MPI, whose free context ids then differed between the nodes)."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "refork", "1,2")
    # (mpirun's status is not checked: an abandoned exchange makes MPI abort the job at exit)
    assert sorted(verdicts) == [0, 1] and verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]


@needs_mpi
def test_close_from_a_signal_handler_during_join(tmp_path):
    """A signal handler calls synk.close() while node 1 waits in join(): join() raises
    SynkError saying so (it raised AttributeError on a freed communicator, or a worker
    'died'), node 0's next call names node 1's close(), and both fork again."""
    rc, output, verdicts = mpirun(tmp_path, 2, "nodes_script.py", "close_in_join", "1,2")
    # (mpirun's status is not checked: an abandoned exchange makes MPI abort the job at exit)
    assert sorted(verdicts) == [0, 1] and verdicts[0]["ok"] and verdicts[1]["ok"], output[-3000:]
    _no_shm_left(tmp_path, 2)
