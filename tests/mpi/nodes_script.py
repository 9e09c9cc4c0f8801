"""One node of a synkhronos job under ``mpirun``: the same script on every node.

Usage: ``mpirun -np N python nodes_script.py OUT SCENARIO SIZES``. ``SIZES``
is the number of processes each node forks (``1,2``: node 0 forks 1, node 1
forks 2, node 2 forks 1 again ...). Each node master writes its verdict
(``verdict.<node>.json``) and, after close(), what of its own is left in
/dev/shm (``shm.<node>.txt``). Scenarios:

- ``ops``: identity and sharding, every output op with uneven rows per node
  and per process, every collective and set_value/get_value with global
  ranks, checked against numpy on the nodes' rows joined in node order; then
  the distribute() mismatch (node 1 builds a different graph).
- ``count``: a short ``ops`` then the distribute() mismatch in count.
- ``kill``: a worker of node 1 is killed; every node's next call raises,
  naming node 1's rank, within seconds; close() is clean.
- ``diverge``: node 1 makes another step than the others (another function,
  op, variable, kind of collective, rank, one collective more): every node
  raises StepMismatchError naming each node's step; the next call works.
- ``leave``: node 1 closes while the others call.
- ``alone``: node 1 (one process) fails an Assert on its rows inside a call.
- ``bad_broadcast``: node 0 gives broadcast() a bad value.
- ``timeout``: fork(timeout=3); node 1 is late for node 0's call.
- ``fail_before_fork``: node 1 fails before fork(); mpirun stops node 0 while
  it waits for MPI to start.
- ``late_start``: node 1 sleeps 5 s before fork(); node 0's fork(timeout=2)
  raises, its next fork() waits.
- ``busy``: a worker of node 1 dies; node 1 raises, then is busy for 5 s;
  node 0's next call raises at once.
- ``uneven``: nodes with different numbers of batches; each calls
  ``synk.join()`` when its run out; the others' calls and reductions go on
  over their own rows; then every node steps together again.
- ``join_close``: node 1 joins, node 0 calls twice, then closes without joining.
- ``random:<seed>:<count>``: random sequences of steps drawn alike on every
  node; node 1 perturbs one step of most of them (scenario_random).
- ``caught``: node 1's own errors, caught by its script (a bad batch, a bad op,
  a failed build), one op-None call more, two output groups against one: every
  node raises in that step and the next one agrees; join() after op-None calls.
- ``joined_collectives``: every shared-variable collective while a node has joined.
- ``fork_retry``: node 0's fork(timeout=0.5) times out while node 1 is late to
  connect, then fork() again; then node 0 is late and node 1's fork(timeout=60) waits.
- ``timeout_usable``: fork(timeout=2), node 1 late for a call: what the error says holds.
- ``close_in_join``: a signal handler calls close() while node 1 waits in join().
- ``planned:<seed>``: random loops of all_reduce over random sets of variables (every op,
  dtypes float32/float64/int32/int64/uint8/bool/complex64, shapes 0-d to (5, 7) and
  (129,)), values set per node with PyTensor's set_value from a seeded rng: every result
  equals ops.combine of the nodes' values in node order, bit for bit, on every node
  (nodes of one process run most steps on the kept MPI plan; avg of integers falls
  back). With 3 nodes or more, a float or complex sum, avg or prod too large for the
  header (Open MPI's ``Iallreduce``, in its own order) is close, and the same bits on
  every node.
- ``diverge_planned``: once the plans are kept, node 1 changes a variable's shape, uses
  another op, skips a step, calls join(): every node raises the same error (or the join
  semantics hold) and the next step agrees.
- ``node_planned:<seed>``: as ``planned`` on nodes of several processes, whose masters
  run most steps alone on their node's homes and the kept exchange (no command).
- ``avg_uneven``: an ``avg`` all_reduce too large for the header on nodes of different
  sizes, 0-d variables among others: close to numpy's mean over the processes.
- ``diverge_node_planned``: ``diverge_planned``'s divergences where the other nodes'
  masters are on their direct plans.
- ``diverge_kept``: nodes of one process keep plans of a broadcast and a reduce; node 0
  changes the variable's shape, node 1 its own copy's, node 1 skips the step, broadcasts
  another variable, all-reduces instead, reduces with another op, in place, or a value of
  another shape, a node joins: every node gets node 0's values or every node's combined,
  or raises the same error, and the next steps agree.

Every node master reports ``plan_steps``: the steps its kept MPI plans made.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from common import Verdict, model_lib

import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos._batching import split

MODE = "FAST_COMPILE"
#: Rows per node (uneven), by node index.
NODE_ROWS = (7, 12, 5)


def node_index() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def children() -> list[int]:
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def my_shm(prefixes) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in prefixes))


def check_identity(v, node, sizes, w):
    n_nodes = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    node_sizes = tuple(sizes[k % len(sizes)] for k in range(n_nodes))
    v.expect(w.node == node and w.nodes == n_nodes, f"world node/nodes {w}")
    v.expect(w.node_sizes == node_sizes and w.size == sum(node_sizes), f"world sizes {w}")
    v.expect(w.rank == sum(node_sizes[:node]) and w.first_rank == w.rank and w.master_rank == 0, f"rank {w}")
    v.expect(w.local_size == node_sizes[node], f"local size {w}")
    # shard: contiguous, in node order, covering every row once
    for n_rows in (0, 1, 5, 101):
        s = synk.shard(n_rows)
        lo = split(n_rows, w.size, w.first_rank)[0]
        hi = split(n_rows, w.size, w.first_rank + w.local_size - 1)[1]
        v.expect((s.start, s.stop) == (lo, hi), f"shard({n_rows}) = {s}")
    return node_sizes


def all_rows(node_sizes):
    """Every node's rows (node k: NODE_ROWS[k]), and each process's split."""
    total = sum(NODE_ROWS[k % 3] for k in range(len(node_sizes)))
    data = (np.arange(total * 3, dtype=np.float64).reshape(total, 3) % 11) - 4.5
    per_node, start = [], 0
    for k in range(len(node_sizes)):
        n = NODE_ROWS[k % 3]
        per_node.append(data[start:start + n])
        start += n
    return data, per_node


def check_outputs(v, node, node_sizes):
    x = pt.dmatrix("x")
    f = synk.function([x], [
        (x.mean(axis=0), "avg"), (x.sum(axis=0), "sum"), ((1 + 0.01 * x).prod(axis=0), "prod"),
        (x.max(axis=0), "max"), (x.min(axis=0), "min"), (x * 2, "gather"), (x.sum(axis=0), None),
        ((x > 0).sum(), "avg")], mode=MODE)
    synk.distribute()
    data, per_node = all_rows(node_sizes)
    mine = per_node[node]
    got = f(mine)
    lo, hi = split(len(mine), node_sizes[node], 0)
    # the int avg: each process's count of positives, weighted by its rows
    procs = [rows[slice(*split(len(rows), node_sizes[k], r))]
             for k, rows in enumerate(per_node) for r in range(node_sizes[k])]
    counts = [(p > 0).sum() for p in procs if len(p)]
    weights = [len(p) for p in procs if len(p)]
    want = [data.mean(0), data.sum(0), (1 + 0.01 * data).prod(0), data.max(0), data.min(0), data * 2,
            mine[lo:hi].sum(0), np.float64(np.dot(counts, weights) / sum(weights))]
    names = ["avg", "sum", "prod", "max", "min", "gather", "None", "int avg"]
    for name, g, w in zip(names, got, want):
        v.expect(np.shape(g) == np.shape(w) and np.allclose(g, w), f"output {name}: {g} != {w}")
    v.expect(np.asarray(got[7]).dtype == np.float64, f"int avg dtype {np.asarray(got[7]).dtype}")
    # no rows on node 1 (it adds nothing; its op-None output is its master's on no rows):
    # the others' rows decide, max and min included (they failed: node 1 computed on nothing)
    f0 = synk.function([x], [(x.mean(axis=0), "avg"), (x.sum(axis=0), "sum"), (x * 2, "gather"),
                             (x.max(axis=0), "max"), (x.min(axis=0), "min"), (x.sum(axis=0), None)],
                       mode=MODE)
    got = f0(mine[:0] if node == 1 else mine)
    rest = np.concatenate([p for k, p in enumerate(per_node) if k != 1])
    v.expect(np.array_equal(got[3], rest.max(0)) and np.array_equal(got[4], rest.min(0)),
             f"max and min without node 1's rows: {got[3]}, {got[4]}")
    own = mine[:0] if node == 1 else mine[slice(*split(len(mine), node_sizes[node], 0))]
    v.expect(np.array_equal(got[5], own.sum(0)), f"op None on node {node}: {got[5]}")
    # no rows on any node: an error on every node (the outputs came back None), then it goes on
    text = raises_soon(v, lambda: f0(mine[:0]), "a call with no rows on any node")
    v.expect(text.startswith("ValueError") and "no node passed any rows" in text, text)
    v.expect(np.allclose(f0(mine)[1], data.sum(0)), "the call after one without rows anywhere")
    v.expect(np.array_equal(got[2], rest * 2), "gather without node 1's rows")
    v.expect(np.allclose(got[0], rest.mean(0)) and np.allclose(got[1], rest.sum(0)),
             f"node 1 without rows: {got[0]} vs {rest.mean(0)}")


def check_collectives(v, node, node_sizes):
    size = sum(node_sizes)
    w = pytensor.shared(np.zeros(3), name="w")
    rows = pytensor.shared(np.zeros((0, 2), dtype=np.int64), name="rows")
    g = synk.function([], [(w.sum(), "sum"), (rows.sum(), "sum")], mode=MODE)
    synk.distribute()
    first = node == 0
    for r in range(size):  # global ranks; node 0's values, the others pass None
        synk.set_value(r, w, np.arange(3.0) + 10 * r if first else None)
    for r in range(size):
        got = synk.get_value(r, w)
        v.expect(np.array_equal(got, np.arange(3.0) + 10 * r), f"get_value({r}) = {got}")
    stacked = synk.gather(w)
    want = np.stack([np.arange(3.0) + 10 * r for r in range(size)])
    v.expect(np.array_equal(stacked, want), f"gather {stacked}")
    lengths = synk.get_lengths(w)
    v.expect(list(lengths) == [3] * size, f"get_lengths {lengths}")
    v.expect(synk.get_shapes(w) == [(3,)] * size, f"get_shapes {synk.get_shapes(w)}")
    out = g()
    v.expect(np.isclose(out[0], want.sum()), f"function over set values {out[0]} vs {want.sum()}")
    for op, fn in (("sum", np.sum), ("max", np.max), ("min", np.min), ("avg", np.mean)):
        got = synk.reduce(w, op, in_place=False)
        v.expect(np.allclose(got, fn(want, axis=0)), f"reduce {op} {got}")
    synk.all_reduce(w, "sum")
    v.expect(np.allclose(synk.gather(w), np.tile(want.sum(0), (size, 1))), "all_reduce sum")
    synk.broadcast(w, np.array([1.0, 2.0, 3.0]) if first else None)
    v.expect(np.array_equal(synk.gather(w), np.tile([1.0, 2.0, 3.0], (size, 1))), "broadcast values")
    synk.reduce(w, "sum")  # in place: every node master's value
    for k in range(len(node_sizes)):  # every node master's, asked by every node (one step for all)
        v.expect(np.array_equal(synk.get_value(sum(node_sizes[:k]), w), [size, 2.0 * size, 3.0 * size]),
                 f"reduce in place on node {k}'s master")
    # scatter of uneven rows by global rank, then all_gather back
    n_rows = 2 * size + 1
    values = np.arange(n_rows * 2, dtype=np.int64).reshape(n_rows, 2)
    synk.scatter(rows, values if first else None)
    lengths = synk.get_lengths(rows)
    v.expect(list(lengths) == [split(n_rows, size, r)[1] - split(n_rows, size, r)[0] for r in range(size)],
             f"scatter lengths {lengths}")
    for r in range(size):
        lo, hi = split(n_rows, size, r)
        v.expect(np.array_equal(synk.get_value(r, rows), values[lo:hi]), f"scatter rank {r}")
    v.expect(np.array_equal(synk.gather(rows, nd_up=0), values), "gather nd_up=0")
    v.expect(np.array_equal(g()[1], values.sum()), "function over scattered rows")
    got = synk.all_gather(rows)
    v.expect(np.array_equal(got, values), "all_gather")
    v.expect(np.array_equal(synk.get_value(size - 1, rows), values), "all_gather stored everywhere")
    try:
        synk.get_value(size, w)
        v.expect(False, "get_value(size) raised nothing")
    except ValueError as err:
        v.expect(f"0..{size - 1}" in str(err), f"get_value(size): {err}")


def check_worker_raises(v, node, node_sizes):
    """A worker of the last node raises (an Assert on its rows): that node's
    call raises the worker's error, every other node's raises PeerFailed
    naming the node; then every node's next call works."""
    from pytensor.raise_op import Assert

    x = pt.dmatrix("x")
    f = synk.function([x], (Assert("row too large")(x.sum(axis=0), pt.all(x < 100)), "sum"), mode=MODE)
    synk.distribute()
    data, per_node = all_rows(node_sizes)
    last = len(node_sizes) - 1
    mine = per_node[node].copy()
    if node == last:  # the last process of the node: a worker when the node has 2
        mine[-1, 0] = 1000.0
    try:
        f(mine)
        v.expect(False, "a worker's error raised nothing")
    except Exception as err:  # noqa: BLE001
        text = f"{type(err).__name__}: {err}"
        if node == last and node_sizes[node] > 1:
            v.expect("row too large" in text, f"the worker's own error on its node: {text}")
        else:
            wrong = f"local rank(s) [{node_sizes[last] - 1}] of node {last}"
            v.expect(node == last or (f"node(s) [{last}]" in text and wrong in text),
                     f"other nodes name the node and the rank: {text}")
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "the next call after a worker's error")


def check_mismatch(v, node, scenario):
    x = pt.dvector("x")
    if scenario == "count":
        fns = [synk.function([x], x.sum(), mode=MODE)]
        if node == 1:
            fns.append(synk.function([x], x.max(), mode=MODE))
    else:
        fns = [synk.function([x], x.sum() if node != 1 else x.max(), mode=MODE, name="h")]
    try:
        synk.distribute()
        v.expect(False, "distribute() of different functions raised nothing")
    except ValueError as err:
        text = str(err)
        want = "built 1 new function" if scenario == "count" else "function #0 differs between nodes"
        v.expect(want in text and "node 1" in text, f"mismatch message: {text}")


def raises_soon(v, call, what: str, limit: float = 10) -> str:
    """Expect ``call()`` to raise within ``limit`` s; the error as "Type: message" ("" if none)."""
    t0 = time.perf_counter()
    try:
        call()
    except Exception as err:  # noqa: BLE001
        took = time.perf_counter() - t0
        text = v.info["error"] = f"{type(err).__name__}: {err}" + "".join(
            f" | {n}" for n in getattr(err, "__notes__", ()))
        v.expect(took < limit, f"raised after {took:.1f} s")
        return text
    v.expect(False, f"{what} raised nothing")
    return ""


def scenario_kill(v, node, node_sizes):
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    data, per_node = all_rows(node_sizes)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "before the kill")
    if node == 1:
        victim = children()[0]
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)
    text = raises_soon(v, lambda: f(per_node[node]), "the call after the kill")
    # (node 1 answers its step by leaving: its call's outputs ride its workers' answers, so its
    # fork breaks before its first exchange; the others learn it in this very step)
    v.expect("rank 1" in text and (node == 1 or text.startswith("NodeFailedError: node 1 ")
                                   and "left after a failure" in text), f"error names node/rank: {text}")
    # every node closes, then forks again (after MPI_Init this time) and goes on
    prefix = synk._state.current().proc.prefix
    synk.close()
    v.expect(my_shm([prefix]) == [], f"left after close: {my_shm([prefix])}")
    synk.fork(node_sizes[node], device="cpu")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "after close() and fork() again")


def scenario_busy_after_kill(v, node, node_sizes):
    """A worker of node 1 dies; node 1's call raises, then its script is busy for 5 s
    (it does not close): node 0's next call raises NodeFailedError naming node 1 at
    once, not when node 1 acts again; every node closes and forks again cleanly."""
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    data, per_node = all_rows(node_sizes)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "before the kill")
    if node == 1:
        os.kill(children()[0], signal.SIGKILL)
        time.sleep(0.5)
    text = raises_soon(v, lambda: f(per_node[node]), "the call after the kill", limit=2.5)
    v.expect("rank 1" in text, f"names the rank: {text}")
    if node == 1:
        time.sleep(5)  # busy with something else
    else:
        # (node 1 left in that very step: see scenario_kill)
        v.expect(text.startswith("NodeFailedError") and "node 1" in text and "left after a failure" in text
                 and "WorkerDiedError" in text, f"names node 1 and its failure: {text}")
        text = raises_soon(v, lambda: f(per_node[node]), "the call after that")
        v.expect("left after a failure" in text and "synk.close()" in text, f"then: {text}")
    synk.close()
    synk.fork(node_sizes[node], device="cpu")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "after close() and fork() again")


def scenario_late_start(v, node, sizes):
    """Node 1 loads its data for 5 s before fork(); node 0's fork(timeout=2) raises
    SynkTimeoutError within seconds, leaving nothing behind; node 0's next fork()
    waits for node 1, and then both call together."""
    if node == 1:
        time.sleep(5)
    else:
        before = set(os.listdir("/dev/shm"))
        t0 = time.perf_counter()
        try:
            synk.fork(sizes[0], device="cpu", timeout=2)
            v.expect(False, "fork(timeout=2) with node 1 late raised nothing")
        except synk.SynkTimeoutError as err:
            took = time.perf_counter() - t0
            v.expect(took < 4.5, f"raised after {took:.1f} s")
            v.expect("MPI did not start" in str(err) and "timeout=2.0" in str(err), str(err))
        v.expect(synk._state.current() is None, "the fork is closed")
        mine = (f"synk.{os.getpid()}.", f"sem.synk.{os.getpid()}.")  # (other jobs may run meanwhile)
        left = sorted(n for n in set(os.listdir("/dev/shm")) - before if n.startswith(mine))
        v.expect(left == [], f"left by the fork that timed out: {left}")
    synk.fork(sizes[node % len(sizes)], device="cpu")
    node_sizes = tuple(sizes[k % len(sizes)] for k in range(int(os.environ["OMPI_COMM_WORLD_SIZE"])))
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    data, per_node = all_rows(node_sizes)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "a call once both forked")
    return synk._state.current().proc.prefix


def scenario_master_fails(v, node, node_sizes, how, out):
    """Node 1's master ends (an uncaught exception, or SIGKILL) while node 0 calls."""
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    data, per_node = all_rows(node_sizes)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "before the failure")
    prefix = synk._state.current().proc.prefix
    (Path(out) / f"prefix.{node}.txt").write_text(prefix)
    if node == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("node 1's script failed on purpose")
    time.sleep(0.5)
    text = raises_soon(v, lambda: f(per_node[node]), "the call after node 1 failed")
    v.expect("node 1" in text and "on purpose" in text, f"error names node 1: {text}")


def scenario_diverge(v, node, node_sizes):
    """Node 1 makes a different step from the others, one kind of divergence at a time:
    every node raises StepMismatchError naming each node's step, within seconds, and
    the next step, the same everywhere, works (the runtime stays usable)."""
    x = pt.dmatrix("x")
    w = pytensor.shared(np.ones(3), name="w")
    u = pytensor.shared(np.ones(3), name="u")
    r = pytensor.shared(np.zeros((0, 2)), name="r")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    g = synk.function([x], (x.sum(axis=0), "max"), mode=MODE, name="g")
    synk.function([], [(w.sum(), "sum"), (u.sum(), "sum"), (r.sum(), "sum")], mode=MODE, name="h")
    synk.distribute()
    data, per_node = all_rows(node_sizes)
    mine = per_node[node]
    size = sum(node_sizes)
    first = node == 0
    for _ in range(2):  # the all_reduces of w and u with max: kept plans on nodes of one process
        synk.all_reduce(w, "max")
        synk.all_reduce(u, "max")
    cases = [  # (name, what every other node does, what node 1 does, words each must show)
        ("f against g", lambda: f(mine), lambda: g(mine), ("call f", "call g")),
        ("a call against all_reduce", lambda: f(mine), lambda: synk.all_reduce(w, "sum"),
         ("call f", "all_reduce([w], op='sum')")),
        ("all_reduce sum against max", lambda: synk.all_reduce(w, "sum"),
         lambda: synk.all_reduce(w, "max"), ("all_reduce([w], op='sum')", "all_reduce([w], op='max')")),
        ("all_reduce of w against u", lambda: synk.all_reduce(w, "sum"),
         lambda: synk.all_reduce(u, "sum"), ("all_reduce([w]", "all_reduce([u]")),
        ("scatter against broadcast", lambda: synk.scatter(r, np.ones((size, 2)) if first else None),
         lambda: synk.broadcast(w), ("scatter([r])", "broadcast([w])")),
        ("set_value(0) against set_value(1)", lambda: synk.set_value(0, w, np.ones(3) if first else None),
         lambda: synk.set_value(1, w, None), ("set_value([w], rank=0)", "set_value([w], rank=1)")),
        ("one collective more on node 1", lambda: f(mine),
         lambda: (synk.all_reduce(w, "sum"), f(mine)), ("call f", "all_reduce([w]")),
        ("gather against all_gather", lambda: synk.gather(w), lambda: synk.all_gather(w),
         ("gather([w]", "all_gather([w]")),
    ]
    for name, others, ones, words in cases:
        text = raises_soon(v, ones if node == 1 else others, name)
        v.expect(text.startswith("StepMismatchError"), f"{name}: {text}")
        want = (f"node 0: {words[0]}", f"node 1: {words[1]}")
        v.expect(all(wd in text for wd in want), f"{name}: {want} in {text}")
        got = f(mine)
        v.expect(np.allclose(got, data.sum(0)), f"the call after {name}: {got}")
    v.info["cases"] = len(cases)
    # the same graph with other output ops on node 1: distribute() says so on every node
    y = pt.dvector("y")
    synk.function([y], (y.sum(), "max" if node == 1 else "sum"), mode=MODE, name="k")
    text = raises_soon(v, synk.distribute, "distribute() of other output ops")
    v.expect("differs between nodes" in text and "different output ops" in text, text)


def scenario_alone_raises(v, node, node_sizes):
    """Node 1 has one process and its rows fail an Assert inside a call (sum, gather,
    max outputs): node 1 raises the Assert, every other node PeerFailed naming node 1
    (they returned a result of their own rows only); then the next call works."""
    from pytensor.raise_op import Assert

    x = pt.dmatrix("x")
    data, per_node = all_rows(node_sizes)
    for op, out, want in (("sum", x.sum(axis=0), data.sum(0)), ("gather", x, data),
                          ("max", x.max(axis=0), data.max(0))):
        f = synk.function([x], (Assert("row too large")(out, pt.all(x < 100)), op), mode=MODE)
        mine = per_node[node].copy()
        if node == 1:
            mine[0, 0] = 1000.0
        text = raises_soon(v, lambda: f(mine), f"{op} with node 1's rows failing")
        first = sum(node_sizes[:node])
        if node == 1:
            v.expect("row too large" in text, f"{op}: node 1's own error: {text}")
            v.expect(f"applied by ranks [], whose shares ran without error, and not by ranks [{first}] of "
                     "this node" in text, f"{op}: node 1 names its global rank as not applying: {text}")
        else:
            v.expect("node(s) [1]" in text, f"{op}: names node 1: {text}")
            ranks = list(range(first, first + node_sizes[node]))
            v.expect(f"applied by ranks {ranks}, whose shares ran without error, and not by ranks [] of "
                     "this node" in text, f"{op}: node {node} names its global ranks as applying: {text}")
        got = f(per_node[node])
        v.expect(np.allclose(got, want), f"{op}: the next call {got}")


# -- random divergence ---------------------------------------------------------------

#: The steps a random sequence draws from (see scenario_random).
STEP_KINDS = ("f", "g", "all_reduce", "broadcast", "broadcast_values", "gather", "get_value",
              "set_value", "reduce")
#: How node 1 perturbs one step of a sequence.
PERTURBATIONS = ("other function", "other op", "other variable", "other kind", "other rank",
                 "skipped", "extra", "other shape")


class _Model:
    """Every process's value of w and u (float64 integers, so every result is exact)."""

    def __init__(self, size):
        self.size = size
        self.vals = {"w": [np.ones(3) for _ in range(size)], "u": [np.full(3, 2.0) for _ in range(size)]}

    def reduce(self, name, op):
        parts = np.stack(self.vals[name])
        return {"sum": parts.sum(0), "max": parts.max(0), "min": parts.min(0)}[op]


def _draw(rng, size):
    """One step: (kind, variable, op, rank, values)."""
    kind = STEP_KINDS[int(rng.integers(len(STEP_KINDS)))]
    return (kind, "wu"[int(rng.integers(2))], ("sum", "max", "min")[int(rng.integers(3))],
            int(rng.integers(size)), rng.integers(-3, 4, size=3).astype(np.float64))


def _key(step) -> tuple:
    """What of a step the nodes compare (as the runtime's step identity does)."""
    kind, var, op, rank, _ = step
    kind = "broadcast" if kind == "broadcast_values" else kind  # the values are node 0's alone
    return (kind, var if kind not in ("f", "g") else None, op if kind in ("all_reduce", "reduce") else None,
            rank if kind in ("get_value", "set_value") else None)


def _perturbed(steps, k, how, size) -> list:
    """What node 1 makes instead of ``steps[k]``: other steps, whose first differs from it."""
    step = steps[k]
    kind, var, op, rank, vals = step
    other_var = "u" if var == "w" else "w"
    if how == "other function":
        alt = [("g" if kind != "g" else "f", var, op, rank, vals)]
    elif how == "other op":
        next_op = {"sum": "max", "max": "min", "min": "sum"}[op]
        alt = [(kind if kind in ("all_reduce", "reduce") else "reduce", var, next_op, rank, vals)]
    elif how == "other variable":
        alt = [(kind if kind not in ("f", "g") else "all_reduce", other_var, op, rank, vals)]
    elif how == "other kind":
        alt = [("gather" if kind != "gather" else "broadcast", var, op, rank, vals)]
    elif how == "other rank":
        alt = [(kind if kind in ("get_value", "set_value") else "get_value", var, op, (rank + 1) % size, vals)]
    elif how == "other shape":  # the same call on rows of another width (a collective: another variable)
        if kind in ("f", "g"):
            return [(kind + "+col", var, op, rank, vals)]
        alt = [(kind, other_var, op, rank, vals)]
    elif how == "skipped":  # node 1 goes on with the next step
        alt = steps[k + 1:k + 2] or [("gather", other_var, op, rank, vals)]
    else:  # extra: a step more, then this one
        alt = [("gather" if kind != "gather" else "all_reduce", var, "max", rank, vals), step]
    if _key(alt[0]) == _key(step):  # e.g. the next step is the same as the skipped one
        alt = [("gather" if kind != "gather" else "get_value", other_var, op, rank, vals)]
    return alt


def _run_step(step, fns, shareds, mine, first, model, data, v, where):
    """Make ``step``; check what it returned and the model's values against numpy."""
    kind, var, op, rank, vals = step
    f, g = fns
    sv = shareds[var]
    size = model.size
    if kind.endswith("+col"):  # rows of 4 columns where the others pass 3 (a perturbation)
        (f if kind == "f+col" else g)(np.hstack([mine, mine[:, :1]]))
    elif kind == "f":
        v.expect(np.array_equal(f(mine), data.sum(0)), f"{where}: f")
    elif kind == "g":
        v.expect(np.array_equal(g(mine), data.max(0)), f"{where}: g")
    elif kind == "all_reduce":
        synk.all_reduce(sv, op)
        model.vals[var] = [model.reduce(var, op)] * size
    elif kind == "reduce":
        got = synk.reduce(sv, op, in_place=False)
        v.expect(np.array_equal(got, model.reduce(var, op)), f"{where}: reduce {op} {got}")
    elif kind == "broadcast":
        synk.broadcast(sv)
        model.vals[var] = [model.vals[var][0]] * size
    elif kind == "broadcast_values":
        synk.broadcast(sv, vals if first else None)
        model.vals[var] = [vals] * size
    elif kind == "gather":
        got = synk.gather(sv)
        v.expect(np.array_equal(got, np.stack(model.vals[var])), f"{where}: gather {got}")
    elif kind == "get_value":
        got = synk.get_value(rank, sv)
        v.expect(np.array_equal(got, model.vals[var][rank]), f"{where}: get_value({rank}) {got}")
    elif kind == "set_value":
        synk.set_value(rank, sv, vals if first else None)
        model.vals[var] = list(model.vals[var])
        model.vals[var][rank] = vals


def scenario_random(v, node, node_sizes, seed, count):
    """``count`` random sequences of 4 to 12 steps drawn alike on every node, from
    ``seed``; in all but every fifth, node 1 perturbs one step (another function, op,
    variable, kind or rank, the step skipped, an extra step). Every unperturbed step
    must match numpy exactly; a perturbed one must raise StepMismatchError on every
    node within seconds, after which every node resets its values (the same step
    everywhere) and goes on. (close() on one node: scenario_leave.)"""
    x = pt.dmatrix("x")
    shareds = {"w": pytensor.shared(np.ones(3), name="w"), "u": pytensor.shared(np.full(3, 2.0), name="u")}
    fns = (synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f"),
           synk.function([x], (x.max(axis=0), "max"), mode=MODE, name="g"))
    synk.function([], [(shareds["w"].sum(), "sum"), (shareds["u"].sum(), "sum")], mode=MODE, name="h")
    synk.distribute()
    data, per_node = all_rows(node_sizes)
    mine, first, size = per_node[node], node == 0, sum(node_sizes)
    counts = {"sequences": 0, "steps": 0, "perturbed": 0, "raised": 0}
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        steps = [_draw(rng, size) for _ in range(int(rng.integers(4, 13)))]
        at = int(rng.integers(len(steps)))
        how = PERTURBATIONS[int(rng.integers(len(PERTURBATIONS)))] if i % 5 else None
        model = _Model(size)
        for name, sv in shareds.items():  # a known start, the same step everywhere
            synk.broadcast(sv, model.vals[name][0] if first else None)
        counts["sequences"] += 1
        for k, step in enumerate(steps):
            where = f"sequence {seed + i} step {k} {step[:4]}"
            if k != at or how is None:
                _run_step(step, fns, shareds, mine, first, model, data, v, where)
                counts["steps"] += 1
                continue
            counts["perturbed"] += 1
            mine_steps = _perturbed(steps, k, how, size) if node == 1 else [step]
            t0 = time.perf_counter()
            try:
                for st in mine_steps:
                    _run_step(st, fns, shareds, mine, first, model, data, v, where)
                v.expect(False, f"{where}: perturbed ({how}: {mine_steps}) and nothing raised")
            except synk.StepMismatchError as err:
                counts["raised"] += 1
                took = time.perf_counter() - t0
                v.expect(took < 10, f"{where}: raised after {took:.1f} s")
                v.expect("node 0:" in str(err) and "node 1:" in str(err), f"{where}: {err}")
            except ValueError as err:  # the same step on arrays of other shapes: their layouts differ
                counts["raised"] += 1
                v.expect(how == "other shape" and "(3,)" in str(err) and "(4,)" in str(err),
                         f"{where} ({how}): {err}")
            except Exception as err:  # noqa: BLE001
                v.expect(False, f"{where} ({how}): {type(err).__name__}: {err}")
            break  # the rest of a perturbed sequence is not drawn alike any more
    v.info["counts"] = counts


def scenario_bad_broadcast(v, node, node_sizes):
    """Node 0 passes broadcast() a value of the wrong ndim (the others pass None): node 0
    raises the ValueError, every other node PeerFailed naming it within seconds (they
    waited for ever), in the same step: the next broadcast works."""
    w = pytensor.shared(np.ones(3), name="w")
    synk.function([], w.sum(), mode=MODE)
    synk.distribute()
    text = raises_soon(v, lambda: synk.broadcast(w, np.ones((2, 2)) if node == 0 else None),
                       "broadcast of a bad value on node 0")
    if node == 0:
        v.expect(text.startswith("TypeError") or text.startswith("ValueError"), f"node 0's own error: {text}")
    else:
        # in the same step (it waited for ever, then was told through the abandoned communicator)
        v.expect(text.startswith("PeerFailed") and "node(s) [0]" in text and "broadcast failed there" in text, text)
    # the step was taken on every node: the next one agrees
    synk.broadcast(w, np.full(3, 2.0) if node == 0 else None)
    v.expect(np.allclose(synk.get_value(sum(node_sizes) - 1, w), 2.0), "the broadcast after the failed one")


def scenario_timeout(v, node, node_sizes):
    """fork(timeout=3) on every node; node 1 is busy with something else for 6 s while
    node 0 calls: node 0's call raises SynkTimeoutError naming the other nodes (it
    blamed a healthy local worker, or "ranks []"), and node 1's call then raises
    NodeFailedError (node 0 told it)."""
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    data, per_node = all_rows(node_sizes)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "before node 1 was late")
    if node == 1:
        time.sleep(6)
        text = raises_soon(v, lambda: f(per_node[node]), "node 1's call after node 0 timed out")
        v.expect(text.startswith("NodeFailedError"), f"node 0 told node 1: {text}")
        return
    text = raises_soon(v, lambda: f(per_node[node]), "a call node 1 is late for")
    v.expect(text.startswith("SynkTimeoutError") and "the other nodes did not reach" in text
             and "worker ranks" not in text, f"names the other nodes: {text}")


def scenario_leave(v, node, node_sizes):
    """Node 1 closes while the others call: they raise StepMismatchError naming its
    close(), and their next call NodeFailedError saying it closed; nothing hangs."""
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    data, per_node = all_rows(node_sizes)
    v.expect(np.allclose(f(per_node[node]), data.sum(0)), "before node 1 closed")
    if node == 1:
        synk.close()
        return
    text = raises_soon(v, lambda: f(per_node[node]), "a call while node 1 closed")
    v.expect("node 1: close()" in text, f"names node 1's close(): {text}")
    text = raises_soon(v, lambda: f(per_node[node]), "the next call")
    v.expect(text.startswith("NodeFailedError") and "node 1 closed" in text, f"node 1 left: {text}")


#: Batches per node (by node index) in the ``uneven`` scenario: node 1 runs out last.
BATCHES = (2, 4, 1)


def batch(t: int, k: int) -> np.ndarray:
    """Node ``k``'s batch ``t``: 2 to 5 rows."""
    rng = np.random.default_rng([t, k])
    return rng.normal(size=(2 + (t + k) % 4, 3))


def scenario_uneven(v, node, node_sizes):
    """Every node loops over its own number of batches, then joins: each step's results
    are those of the nodes still passing rows, never another step's values."""
    n = len(node_sizes)
    x = pt.dmatrix("x")
    w = pytensor.shared(np.full(3, node + 1.0), name="w")  # each node's own value
    f = synk.function([x], [(x.mean(axis=0), "avg"), (x.sum(axis=0), "sum"), (x.max(axis=0), "max"),
                            (x.min(axis=0), "min"), (x * 2, "gather"), ((x > 0).sum(), "avg")],
                      mode=MODE, name="f")
    synk.function([], (w.sum(), "sum"), mode=MODE)  # the workers hold w
    synk.distribute()
    mine = BATCHES[node % 3]
    for t in range(mine):
        got = f(batch(t, node))
        active = [k for k in range(n) if BATCHES[k % 3] > t]
        rows = np.concatenate([batch(t, k) for k in active])
        procs = [b[slice(*split(len(b), node_sizes[k], r))] for k in active for b in [batch(t, k)]
                 for r in range(node_sizes[k])]
        procs = [p for p in procs if len(p)]
        int_avg = np.dot([(p > 0).sum() for p in procs], [len(p) for p in procs]) / len(rows)
        want = [rows.mean(0), rows.sum(0), rows.max(0), rows.min(0), rows * 2, int_avg]
        for name, g, e in zip(["avg", "sum", "max", "min", "gather", "int avg"], got, want):
            v.expect(np.shape(g) == np.shape(e) and np.allclose(g, e),
                     f"step {t} (nodes {active}) output {name}: {g} != {e}")
        red = synk.reduce(w, "sum", in_place=False)
        e = sum(node_sizes[k] * (k + 1.0) for k in active)
        v.expect(np.allclose(red, e), f"step {t}: reduce over nodes {active}: {red} != {e}")
    last = synk.join()
    longest = max(range(n), key=lambda k: (BATCHES[k % 3], -k))
    v.expect(last == longest, f"join() returned {last}, the last to join was node {longest}")
    # together again: every node's rows
    full = np.concatenate([batch(9, k) for k in range(n)])
    got = f(batch(9, node))
    v.expect(np.allclose(got[1], full.sum(0)), f"after join: {got[1]} != {full.sum(0)}")
    # node 0 joins first; the others' broadcast of node 0's values raises, naming it
    if node != 0:
        text = raises_soon(v, lambda: synk.broadcast(w, None), "a broadcast from node 0 that joined")
        v.expect(text.startswith("ValueError") and "node 0 has joined" in text, text)
    v.expect(synk.join() == min(k for k in range(n) if k != 0), "the second join's last node")
    got = f(batch(9, node))
    v.expect(np.allclose(got[1], full.sum(0)), f"after the second join: {got[1]}")
    v.info["cases"] = mine


def scenario_join_close(v, node, node_sizes):
    """Node 1 joins at once; node 0 calls twice (alone), then closes without joining."""
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    synk.distribute()
    if node == 1:
        text = raises_soon(v, synk.join, "join() while node 0 closes", limit=60)
        v.expect(text.startswith("SynkError") and "closed" in text and "without joining" in text, text)
        return
    for t in range(2):
        b = batch(t, 0)
        v.expect(np.allclose(f(b), b.sum(0)), f"node 0 alone, step {t}")


# -- steps that stay true after a user's own error, a join or a timeout ----------------------


def _step_ok(v, what, call, want):
    """``call()`` returns ``want`` (checked against numpy)."""
    try:
        got = call()
    except Exception as err:  # noqa: BLE001
        v.expect(False, f"{what}: raised {type(err).__name__}: {err}")
        return
    v.expect(np.allclose(got, want), f"{what}: {got} != {want}")


def scenario_caught(v, node, node_sizes):
    """Node 1 fails a local check and its script catches it (finding 1), builds a
    function that fails to compile (6), makes one more op-None call (4), calls a
    function of one output group where node 0 calls one of two (5): every node
    raises on that step, never returns a wrong value, and the next identical step
    works. Then node 1's last calls before join() have op None only (3): join()
    names node 1 on every node."""
    x = pt.dmatrix("x")
    w = pytensor.shared(np.full(3, node + 1.0), name="w")
    data, per_node = all_rows(node_sizes)
    mine = per_node[node]
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    f2 = synk.function([x], [(x.sum(axis=0), "sum"), (x.max(axis=0), "max")], mode=MODE, name="f2")
    h = synk.function([x], (x.sum(axis=0), None), mode=MODE, name="h")
    synk.function([], (w.sum(), "sum"), mode=MODE, name="k")
    if node == 1:  # (6) a build that fails after its id was taken, caught
        try:
            synk.function([x], x.sum(), mode="NoSuchMode")
            v.expect(False, "the bad build raised nothing")
        except Exception:  # noqa: BLE001
            pass
    g = synk.function([x], (x.min(axis=0), "min"), mode=MODE, name="g")
    synk.distribute()
    _step_ok(v, "(6) the first call of a function built after node 1's failed build", lambda: g(mine),
             data.min(0))
    # (1) a bad batch on node 1, caught: every node raises in that step
    text = raises_soon(v, (lambda: f(mine, batch=[0, 99])) if node == 1 else (lambda: f(mine)),
                       "(1) a call that failed a check on node 1")
    v.expect(text.startswith("IndexError") if node == 1 else "node(s) [1]" in text, f"(1): {text}")
    for t in range(2):
        _step_ok(v, f"(1) call {t} after the caught error", lambda: f(mine), data.sum(0))
    # (1) the same for a collective: a bad op on node 1
    text = raises_soon(v, (lambda: synk.all_reduce(w, "no such op")) if node == 1
                       else (lambda: synk.all_reduce(w, "sum")), "(1) a collective that failed on node 1")
    v.expect(text.startswith("ValueError") if node == 1 else "node(s) [1]" in text, f"(1) all_reduce: {text}")
    wsum = sum(node_sizes[k] * (k + 1.0) for k in range(len(node_sizes)))
    _step_ok(v, "(1) reduce after the failed collective", lambda: synk.reduce(w, "sum", in_place=False), wsum)
    # (4) one op-None call more on node 1
    if node == 1:
        text = raises_soon(v, lambda: h(mine), "(4) node 1's extra op-None call")
        v.expect(text.startswith("StepMismatchError"), f"(4) node 1: {text}")
    else:
        text = raises_soon(v, lambda: f(mine), "(4) the call node 1's extra call met")
        v.expect(text.startswith("StepMismatchError"), f"(4): {text}")
    for t in range(2):
        _step_ok(v, f"(4) call {t} after the extra op-None call", lambda: f(mine), data.sum(0))
    # (5) two output groups against one
    text = raises_soon(v, (lambda: f(mine)) if node == 1 else (lambda: f2(mine)), "(5) f2 against f")
    v.expect(text.startswith("StepMismatchError") and "ranks [" not in text.split("|")[0], f"(5): {text}")
    for t in range(2):
        _step_ok(v, f"(5) call {t} after f2 against f", lambda: f(mine), data.sum(0))
    _step_ok(v, "(5) f2 after f2 against f", lambda: f2(mine)[1], data.max(0))
    # (3) node 1's last calls have op None only: join() names node 1
    _step_ok(v, "(3) the call before", lambda: f(mine), data.sum(0))
    if node == 1:
        for t in range(2):
            own = mine[slice(*split(len(mine), node_sizes[node], 0))]  # op None: the master's rows
            _step_ok(v, f"(3) node 1's op-None call {t}", lambda: h(mine), own.sum(0))
    last = synk.join()
    v.expect(last == 1, f"(3) join() returned {last}, node 1 joined last")
    _step_ok(v, "the call after join()", lambda: f(mine), data.sum(0))


def scenario_joined_collectives(v, node, node_sizes):
    """Node 1 joins at once; node 0 then runs every shared-variable collective (finding 2):
    scatter refuses (it would drop node 1's rows), set_value and get_value of node 1's
    rank raise ValueError naming the join, gather, all_gather, get_lengths and get_shapes
    leave node 1 out; a broadcast, scatter and set_value of node 0's values while node 0
    has joined name their own operation (finding 9). Then every node steps together."""
    w = pytensor.shared(np.full(3, node + 1.0), name="w")
    r = pytensor.shared(np.zeros((2, 2)), name="r")
    synk.function([], [(w.sum(), "sum"), (r.sum(), "sum")], mode=MODE, name="k")
    synk.distribute()
    n0 = node_sizes[0]
    other = n0  # node 1's first global rank
    if node == 1:
        v.expect(synk.join() == 0, "node 0 joined last")
    else:
        text = raises_soon(v, lambda: synk.scatter(r, np.ones((8, 2))), "scatter while node 1 joined")
        v.expect(text.startswith("ValueError") and "join" in text and "node" in text, f"scatter: {text}")
        text = raises_soon(v, lambda: synk.set_value(other, w, np.zeros(3)), "set_value of a joined rank")
        v.expect(text.startswith("ValueError") and "join" in text, f"set_value: {text}")
        text = raises_soon(v, lambda: synk.get_value(other, w), "get_value of a joined rank")
        v.expect(text.startswith("ValueError") and "join" in text, f"get_value: {text}")
        for name, call, want in (
                ("gather", lambda: synk.gather(w), np.ones((n0, 3))),
                ("all_gather", lambda: synk.all_gather(r), np.zeros((2 * n0, 2))),
                ("get_lengths", lambda: synk.get_lengths(r), np.full(n0, 2 * n0)),
                ("get_shapes", lambda: np.array(synk.get_shapes(w)), np.full((n0, 1), 3))):
            try:
                got = call()
                v.expect(np.shape(got) == np.shape(want) and np.allclose(got, want), f"{name}: {got} != {want}")
            except Exception as err:  # noqa: BLE001
                v.expect(False, f"{name} while node 1 joined: {type(err).__name__}: {err}")
        _step_ok(v, "set_value of node 0's own rank", lambda: (synk.set_value(0, w, np.full(3, 5.0)),
                                                                synk.get_value(0, w))[1], np.full(3, 5.0))
        v.expect(synk.join() == 0, "node 0 joined last")
    # node 0 joins; node 1 reads values from it: each error names its own operation
    if node == 0:
        v.expect(synk.join() == 1, "node 1 joined last (second join)")
    else:
        for what, call in (("broadcast", lambda: synk.broadcast(w)),
                           ("scatter", lambda: synk.scatter(r, None)),
                           ("set_value", lambda: synk.set_value(other, w, None))):
            text = raises_soon(v, call, f"{what} from node 0 that joined")
            v.expect(text.startswith(f"ValueError: {what}") and "joined" in text, f"{what}: {text}")
        v.expect(synk.join() == 1, "node 1 joined last (second join)")
    got = synk.reduce(w, "sum", in_place=False)
    v.expect(got is not None and np.isfinite(got).all(), f"a reduce after both joins: {got}")


def scenario_fork_retry(v, node, sizes):
    """Finding 7: node 1 is 3 s late to make the communicator among the nodes (after MPI
    started); node 0's fork(timeout=0.5) raises SynkTimeoutError (never the private
    _TimedOut), its retry fork() without a timeout waits for node 1 (fork(timeout=60)),
    and both then call together; no "waited 3036 s" warning anywhere."""
    import logging

    warned = []

    class Catch(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage())

    logging.getLogger("synkhronos").addHandler(Catch())
    if node == 1:
        import synkhronos._protocol.across_nodes as sn

        real = sn.BACKENDS["mpi"]

        def late(*args, **kwargs):
            time.sleep(3)
            return real(*args, **kwargs)

        sn.BACKENDS = dict(sn.BACKENDS, mpi=late)
        t0 = time.perf_counter()
        try:
            synk.fork(sizes[1 % len(sizes)], device="cpu", timeout=60)
        except BaseException as err:  # noqa: BLE001
            v.expect(False, f"node 1's fork(timeout=60): {type(err).__name__}: {err}")
            raise
        sn.BACKENDS = dict(sn.BACKENDS, mpi=real)
        v.expect(time.perf_counter() - t0 < 30, "node 1's fork took long")
    else:
        t0 = time.perf_counter()
        try:
            synk.fork(sizes[0], device="cpu", timeout=0.5)
            v.expect(False, "node 0's fork(timeout=0.5) raised nothing")
        except synk.SynkTimeoutError as err:
            v.expect(time.perf_counter() - t0 < 2.5, f"raised after {time.perf_counter() - t0:.1f} s")
            v.info["error"] = str(err)
        except BaseException as err:  # noqa: BLE001
            v.expect(False, f"node 0's fork(timeout=0.5): {type(err).__module__}.{type(err).__name__}: {err}")
        v.expect(synk._state.current() is None, "the fork that timed out is closed")
        synk.fork(sizes[0], device="cpu")
    node_sizes = tuple(sizes[k % len(sizes)] for k in range(int(os.environ["OMPI_COMM_WORLD_SIZE"])))
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    data, per_node = all_rows(node_sizes)
    _step_ok(v, "a call once both forked", lambda: f(per_node[node]), data.sum(0))
    # node 0 is 4 s late to fork again: node 1's fork(timeout=60) waits for it (it raised the
    # private _TimedOut after 3 s: the wait's start was never set)
    synk.close()
    if node == 0:
        time.sleep(4)
    try:
        synk.fork(sizes[node % len(sizes)], device="cpu", timeout=60 if node == 1 else None)
    except BaseException as err:  # noqa: BLE001
        v.expect(False, f"fork() again: {type(err).__module__}.{type(err).__name__}: {err}")
        raise
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    _step_ok(v, "a call once both forked again", lambda: f(per_node[node]), data.sum(0))
    long_waits = [m for m in warned if "waited" in m]
    v.expect(not long_waits, f"warnings of long waits: {long_waits}")
    return synk._state.current().proc.prefix


def scenario_timeout_usable(v, node, node_sizes):
    """Finding 8: fork(timeout=2); node 1 is 5 s late for a call: node 0's SynkTimeoutError
    either says synkhronos is usable and the next call works, or says to close() and fork()
    again, and doing so works on every node."""
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    data, per_node = all_rows(node_sizes)
    mine = per_node[node]
    _step_ok(v, "before node 1 was late", lambda: f(mine), data.sum(0))
    if node == 1:
        time.sleep(5)
        text = raises_soon(v, lambda: f(mine), "node 1's late call")
    else:
        text = raises_soon(v, lambda: f(mine), "a call node 1 is late for")
        v.expect(text.startswith("SynkTimeoutError"), f"node 0: {text}")
    if "is usable" in text:
        _step_ok(v, "the call after an error that says usable", lambda: f(mine), data.sum(0))
    else:
        v.expect("synk.close()" in text and "synk.fork()" in text, f"says what to do: {text}")
        synk.close()
        synk.fork(node_sizes[node], device="cpu", timeout=20)
        f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
        _step_ok(v, "a call after close() and fork()", lambda: f(mine), data.sum(0))


def scenario_close_in_join(v, node, node_sizes):
    """Finding 9: node 1 joins; a signal handler calls synk.close() while it waits in
    join(): join() raises SynkError saying close() was called, the fork is closed,
    nothing leaks; node 0's call raises naming node 1's close(), never a worker death;
    both fork again and call together."""
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    data, per_node = all_rows(node_sizes)
    mine = per_node[node]
    _step_ok(v, "before", lambda: f(mine), data.sum(0))
    if node == 1:
        old = signal.signal(signal.SIGUSR1, lambda *_: synk.close())
        signal.setitimer(signal.ITIMER_REAL, 0)
        threading_timer = __import__("threading").Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        threading_timer.start()
        text = raises_soon(v, synk.join, "join() closed by a signal handler")
        signal.signal(signal.SIGUSR1, old)
        v.expect(text.startswith("SynkError") and "close()" in text and "join" in text, f"node 1: {text}")
        v.expect(synk._state.current() is None, "node 1's fork is closed")
    else:
        time.sleep(3)  # (a call before node 1's close() is served by its join(): node 0's rows only)
        text = raises_soon(v, lambda: f(mine), "node 0's call after node 1 closed in join()")
        v.expect("died" not in text and "close" in text and "node 1" in text, f"node 0: {text}")
        synk.close()
    synk.fork(node_sizes[node], device="cpu")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    _step_ok(v, "a call after both forked again", lambda: f(mine), data.sum(0))


def scenario_timeout_planned(v, node, node_sizes, late):
    """Once the all_reduce of w is kept on every node (a node of one process: its MPI plan;
    of several: its master's direct plan), with a timeout of 2 s: node ``late`` ("0" or "1")
    is 4 s late: the other's all_reduce on its plan raises SynkTimeoutError naming the other
    nodes (it raised the private _TimedOut), the late one's NodeFailedError; or ("close")
    node 1 is 3 s late and a signal handler calls synk.close() during node 0's planned
    all_reduce: SynkError saying so, the fork closed (it stayed open), node 1's next step
    NodeFailedError. (One case per job: forking again after an abandoned exchange is
    another test's, scenario_timeout_usable.)"""
    x = pt.dmatrix("x")
    s = synk._state.current()
    w = pytensor.shared(np.full(3, node + 1.0), name="w")
    synk.function([x], ((x * w).sum(axis=0), "sum"), mode=MODE, name="f")  # (the workers hold w)
    synk.distribute()
    for _ in range(3):
        w.set_value(np.full(3, node + 1.0))
        synk.all_reduce(w, "max")
    plan_steps, generation = s.proc.comm.inter.plan_steps, s.kept.generation
    _step_ok(v, "the planned all_reduce", lambda: (synk.all_reduce(w, "max"), w.get_value())[1],
             np.full(3, float(len(node_sizes))))
    v.expect(s.proc.comm.inter.plan_steps == plan_steps + 1 if node_sizes[node] == 1 else
             s.kept.generation == generation, "the all_reduce was not on its plan")
    if late != "close":
        s.timeout = 2.0  # (the bound of the step the late node is late for)
        if node == int(late):
            time.sleep(4)
            text = raises_soon(v, lambda: synk.all_reduce(w, "max"), "the late node's all_reduce")
            v.expect(text.startswith("NodeFailedError") and "timeout" in text, f"late node {node}: {text}")
        else:
            text = raises_soon(v, lambda: synk.all_reduce(w, "max"), "an all_reduce the other node is late for")
            v.expect(text.startswith("SynkTimeoutError") and "the other nodes did not reach" in text
                     and "synk.close()" in text, f"node {node}, node {late} late: {text}")
    elif node == 1:
        time.sleep(3)
        text = raises_soon(v, lambda: synk.all_reduce(w, "max"), "node 1's all_reduce after node 0 closed")
        v.expect(text.startswith("NodeFailedError") and "close()" in text, f"node 1: {text}")
    else:
        old = signal.signal(signal.SIGUSR1, lambda *_: synk.close())
        timer = __import__("threading").Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        timer.start()
        text = raises_soon(v, lambda: synk.all_reduce(w, "max"), "a planned all_reduce closed by a signal handler")
        signal.signal(signal.SIGUSR1, old)
        v.expect(text.startswith("SynkError") and "synk.close() was called" in text and "all_reduce" in text,
                 f"node 0: {text}")
        v.expect(synk._state.current() is None, "node 0's fork is closed")


def scenario_refork(v, node, node_sizes):
    """Forks again after exchanges abandoned on each node in turn, six times: node 0 is 4 s
    late for an all_reduce (node 1 times out and abandons its exchange), every node closes
    and forks again, then node 1 is late (node 0 abandons), and so on: every fork() and a
    call after it work on every node (in about half of such jobs one fork() hung in Open
    MPI's two outstanding Idups, whose free context ids then differed between the nodes: a
    communicator still held by an abandoned exchange on one node only)."""
    x = pt.dmatrix("x")
    data, per_node = all_rows(node_sizes)
    for k, late in enumerate((0, 1, 0, 1, 0, 1, None)):
        if synk._state.current() is None:
            # every node reaches fork() together: a barrier through files
            (v.path.parent / f"refork{k}.{node}").touch()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                    (v.path.parent / f"refork{k}.{n}").exists() for n in range(len(node_sizes))):
                time.sleep(0.01)
            synk.fork(node_sizes[node], device="cpu", timeout=20.0)
        s = synk._state.current()
        s.timeout = 20.0
        w = pytensor.shared(np.full(3, node + 1.0), name="w")
        f = synk.function([x], ((x * w).sum(axis=0), "sum"), mode=MODE, name="f")
        _step_ok(v, f"a call after fork() (node {late} late next)", lambda: f(per_node[node]),
                 (data * (np.repeat(np.arange(1.0, len(node_sizes) + 1), [len(p) for p in per_node])[:, None])).sum(0))
        if late is None:
            return
        for _ in range(3):
            synk.all_reduce(w, "max")
        s.timeout = 2.0
        if node == late:
            time.sleep(4)
        text = raises_soon(v, lambda: synk.all_reduce(w, "max"), f"an all_reduce node {late} is late for")
        v.expect(text.startswith("NodeFailedError" if node == late else "SynkTimeoutError"), f"node {node}: {text}")
        synk.close()


PLAN_OPS = ("sum", "avg", "prod", "max", "min")
PLAN_DTYPES = (np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_, np.complex64)
PLAN_SHAPES = ((), (1,), (3,), (5, 7), (129,))


def _plan_value(seed, step, i, node, dtype, shape):
    """Node ``node``'s value of variable ``i`` at ``step`` (any node can draw it)."""
    rng = np.random.default_rng([seed, step, i, node])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -3, 4, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.uniform(-2, 2, shape) + 1j * rng.uniform(-2, 2, shape)).astype(dtype)
    return rng.uniform(-2, 2, shape).astype(dtype)


def scenario_planned(v, node, node_sizes, seed, count=150):
    """Random all_reduce loops on every node alike, results bit for bit against
    ops.combine of the nodes' values in node order (see the module's docstring)."""
    from synkhronos.collectives.mpi_wire import payload_fits
    from synkhronos.collectives.ops import cast_to, combine, result_dtype

    rng = np.random.default_rng(seed)  # the same draws on every node
    kinds = [(np.dtype(PLAN_DTYPES[int(rng.integers(len(PLAN_DTYPES)))]),
              PLAN_SHAPES[int(rng.integers(len(PLAN_SHAPES)))]) for _ in range(6)]
    shared = [pytensor.shared(np.zeros(shape, dtype), name=f"p{i}") for i, (dtype, shape) in enumerate(kinds)]
    synk.function([], [(sv.sum(), "sum") for sv in shared], mode=MODE, name="h")
    synk.distribute()
    n = len(node_sizes)
    inter = synk._state.current().proc.comm.inter
    model: list = [None] * len(kinds)  # per variable: every node's value
    checked = 0
    for step in range(count):
        chosen = sorted(int(i) for i in rng.choice(len(kinds), int(rng.integers(1, 4)), replace=False))
        op = PLAN_OPS[int(rng.integers(len(PLAN_OPS)))]
        for i in chosen:
            if model[i] is None or rng.random() < 0.5:
                model[i] = [_plan_value(seed, step, i, k, *kinds[i]) for k in range(n)]
                shared[i].set_value(model[i][node])
        want = [cast_to(np.asarray(combine(model[i], op)), kinds[i][0]) for i in chosen]
        where = f"step {step}: all_reduce({chosen}, {op!r}) of {[kinds[i] for i in chosen]}"
        before = inter.plan_steps
        try:
            synk.all_reduce([shared[i] for i in chosen], op)
        except Exception as err:  # noqa: BLE001
            v.expect(False, f"{where}: {type(err).__name__}: {err}")
            return
        # (the full path's own test: whether the values travel in the header slot after its blob)
        values = [np.zeros(kinds[i][1], result_dtype(kinds[i][0], op)) for i in chosen]
        blob = pickle.dumps(([(a.dtype, a.shape) for a in values], 1.0, False, False), protocol=pickle.HIGHEST_PROTOCOL)
        large = not payload_fits(values, len(blob))
        if large and inter.plan_steps > before:
            v.info["large_plan_steps"] = v.info.get("large_plan_steps", 0) + 1  # (on the large plan)
        # (values too large to travel in the header: with 3 nodes or more MPI sums and
        # multiplies floats in its own order: only there, close is enough, and every node
        # must hold the same bits all the same; with 2 the ring folds with numpy, in node order)
        loose = large and n > 2 and op in ("sum", "avg", "prod")
        for i, w in zip(chosen, want):
            got = shared[i].get_value(borrow=True)
            checked += 1
            close = loose and w.dtype.kind in "fc" and np.allclose(got, w, rtol=1e-5)
            v.expect(got.dtype == w.dtype and got.shape == w.shape and (got.tobytes() == w.tobytes() or close),
                     f"{where}: p{i} {got!r} != {w!r}")
            if loose:  # (every node the same bits all the same)
                v.info.setdefault("digests", []).append(zlib.crc32(got.tobytes()))
            model[i] = [np.array(got)] * n
    v.info["checked"] = checked


NODE_PLAN_DTYPES = (np.float32, np.float64, np.int32, np.int64, np.uint8, np.complex64)
NODE_PLAN_SHAPES = ((), (1,), (3,), (2, 5), (40,))


def scenario_node_planned(v, node, node_sizes, seed, count=160):
    """Nodes of several processes: random all_reduce loops over random sets of variables
    (every op; float32, float64, int32, int64, uint8, complex64; 0-d to (40,), some too large for the
    node master's direct plan), drawn alike on every node. Each node's master sets a new
    value of a variable in a fifth of its steps (that step takes the full path: the
    variable holds another array than its home), node 0's alone in another seventh (the
    others stay on their plans: an avg there weighs the nodes' values), its workers hold
    the last result. Every result, in
    every process of every node, equals the full path's hierarchy of ops.combine, bit
    for bit: each node's processes in rank order, then the nodes in node order (an
    ``avg`` weighted by the nodes' sizes). Counts the steps made with no command (the
    node master's direct plan: the kept generation did not move) and checks every
    process's values with a gather every few steps."""
    from synkhronos.collectives.ops import cast_to, combine

    rng = np.random.default_rng(seed)  # the same draws on every node
    kinds = [(np.dtype(NODE_PLAN_DTYPES[int(rng.integers(len(NODE_PLAN_DTYPES)))]),
              NODE_PLAN_SHAPES[int(rng.integers(len(NODE_PLAN_SHAPES)))]) for _ in range(6)]
    shared = [pytensor.shared(np.zeros(shape, dtype), name=f"p{i}") for i, (dtype, shape) in enumerate(kinds)]
    extra = pytensor.shared(np.ones(3), name="a")
    synk.function([], [(sv.sum(), "sum") for sv in [*shared, extra]], mode=MODE, name="h")
    synk.distribute()
    n, s = len(node_sizes), synk._state.current()
    masters = [[np.zeros(shape, dtype)] * n for dtype, shape in kinds]  # per variable: each node master's value
    rest = [np.zeros(shape, dtype) for dtype, shape in kinds]  # per variable: every worker's (the last result)
    checked = direct = 0
    for step in range(count):
        chosen = sorted(int(i) for i in rng.choice(len(kinds), int(rng.integers(1, 4)), replace=False))
        ints = any(kinds[i][0].kind in "iu" for i in chosen)
        op = [o for o in PLAN_OPS if not (ints and o == "avg")][int(rng.integers(4 if ints else 5))]
        for i in chosen:
            r = rng.random()
            if r < 0.35:  # new values on every node, or on node 0 alone (the others stay on their plans)
                masters[i] = [_plan_value(seed, step, i, k, *kinds[i]) if r < 0.2 or k == 0 else masters[i][k]
                              for k in range(n)]
                if r < 0.2 or node == 0:
                    shared[i].set_value(masters[i][node])
        want = []
        for i in chosen:
            parts = [combine([masters[i][k]] + [rest[i]] * (node_sizes[k] - 1), op) for k in range(n)]
            whole = combine(parts, op, [float(size) for size in node_sizes] if op == "avg" else None)
            want.append(cast_to(np.asarray(whole), kinds[i][0]))
        where = f"step {step}: all_reduce({chosen}, {op!r}) of {[kinds[i] for i in chosen]}"
        generation = s.kept.generation
        try:
            synk.all_reduce([shared[i] for i in chosen], op)
        except Exception as err:  # noqa: BLE001
            v.expect(False, f"{where}: {type(err).__name__}: {err}")
            return
        direct += s.kept.generation == generation  # (no command posted: the direct plan)
        for i, w in zip(chosen, want):
            got = shared[i].get_value(borrow=True)
            checked += 1
            v.expect(got.dtype == w.dtype and got.shape == w.shape and got.tobytes() == w.tobytes(),
                     f"{where}: p{i} {got!r} != {w!r}")
            masters[i], rest[i] = [np.array(w)] * n, np.array(w)
        if step % 8 == 7:  # every process of every node holds the last results
            for i, g in enumerate(synk.gather(shared)):
                parts = list(np.asarray(g))
                v.expect(len(parts) == sum(node_sizes) and all(p.tobytes() == rest[i].tobytes() for p in parts),
                         f"step {step}: gathered p{i} {g!r}, every process should hold {rest[i]!r}")
    v.info["checked"], v.info["direct"] = checked, direct
    # an avg weighs the nodes by their sizes on the plans too: node 0's master alone changes
    # its value, the other nodes' stay on their direct plans (values unlike node 0's)
    every, direct = np.ones(3), 0
    for t in range(6):
        new = np.full(3, 10.0 * (t + 1)) + t / 7
        if node == 0:
            extra.set_value(new)
        parts = [combine([new if k == 0 else every] + [every] * (node_sizes[k] - 1), "avg") for k in range(n)]
        want = cast_to(np.asarray(combine(parts, "avg", [float(size) for size in node_sizes])), np.float64)
        generation = s.kept.generation
        synk.all_reduce(extra, "avg")
        direct += s.kept.generation == generation
        got = extra.get_value(borrow=True)
        v.expect(got.tobytes() == want.tobytes(), f"avg {t} with node 0's new value: {got!r} != {want!r}")
        every = np.array(want)
    v.info["direct_avg"] = direct


def scenario_planned_calls(v, node, node_sizes, seed, count=160):
    """Random calls drawn alike on every node, repeated with the same shapes so that a node
    of one process keeps its output reduction (the MPI call plan), with new row counts now
    and then (equal on every node: the plan's exchange; unequal: its weights differ, the
    slots are read the long way): every op (sum, avg, max, min, prod) on float64, float32 and
    int64 outputs, a call with two outputs of one op and one with three ops (three exchanges,
    each on its own plan). Each result against numpy over
    every node's rows, and its bits recorded (the test compares them across nodes). Twice
    node 1's rows fail inside a planned call: node 1 raises its Assert, the others
    PeerFailed naming node 1, and the next call agrees again."""
    from pytensor.raise_op import Assert

    rng = np.random.default_rng(seed)  # the same draws on every node
    n = len(node_sizes)
    want_of = {"sum": lambda d: d.sum(0), "max": lambda d: d.max(0), "min": lambda d: d.min(0),
               "prod": lambda d: d.prod(0), "avg": lambda d: d.mean(0)}
    cases = []
    for dtype in ("float64", "float32", "int64"):
        x = pt.matrix("x", dtype=dtype)
        ok = pt.all(x < 100)
        for op in ("sum", "max", "min", "prod") + (("avg",) if dtype != "int64" else ()):
            out = {"sum": x.sum(axis=0), "max": x.max(axis=0), "min": x.min(axis=0), "prod": x.prod(axis=0),
                   "avg": x.mean(axis=0)}[op]
            cases.append((dtype, (op,), synk.function([x], (Assert("row too large")(out, ok), op), mode=MODE),
                          lambda d, op=op: [want_of[op](d)]))
    x2 = pt.dmatrix("x2")
    cases.append(("float64", ("sum", "sum"), synk.function([x2], [(x2.sum(axis=0), "sum"), ((x2 ** 2).sum(), "sum")],
                                                            mode=MODE), lambda d: [d.sum(0), (d ** 2).sum()]))
    x3 = pt.dmatrix("x3")  # three groups of outputs: three exchanges, each its own plan
    cases.append(("float64", ("sum", "max", "avg"), synk.function(
        [x3], [(x3.sum(axis=0), "sum"), (x3.max(axis=0), "max"), (x3.mean(), "avg")], mode=MODE),
        lambda d: [d.sum(0), d.max(0), d.mean()]))
    # gathered rows (every process's, node-major: the rows in order), beside a sum or alone
    x4 = pt.dmatrix("x4")
    cases.append(("float64", ("sum", "gather"), synk.function(
        [x4], [(x4.sum(axis=0), "sum"), (Assert("row too large")(x4 * 2, pt.all(x4 < 100)), "gather")], mode=MODE),
        lambda d: [d.sum(0), d * 2]))
    x5 = pt.matrix("x5", dtype="int64")
    cases.append(("int64", ("gather",), synk.function(
        [x5], (Assert("row too large")(x5 + 1, pt.all(x5 < 100)), "gather"), mode=MODE), lambda d: [d + 1]))
    inter = synk._state.current().proc.comm.inter
    fails = {int(count * 0.4), int(count * 0.8)}
    case, rows, width, planned, digests = cases[0], [2] * n, 3, 0, []
    for step in range(count):
        if rng.random() < 0.2:
            case = cases[int(rng.integers(len(cases)))]
        if rng.random() < 0.15:  # new rows: equal on every node, or not
            width = int(rng.integers(1, 5))
            rows = [int(rng.integers(1, 5))] * n if rng.random() < 0.5 else [int(r) for r in rng.integers(1, 5, n)]
        dtype, ops, f, want = case
        datas = [rng.choice(np.array([-2, -1, 1, 2]), size=(rows[k], width)).astype(dtype) for k in range(n)]
        data = np.concatenate(datas)
        where = f"step {step}: {ops} of {dtype}, rows {rows}, width {width}"
        if step in fails:  # the first time node 1's first row (its master's), then its last (a worker's)
            mine = datas[node].copy()
            if node == 1:
                mine[0 if step == min(fails) else -1, 0] = 1000
            else:  # node 1 then waits for the others in the step it tells them of (its check runs)
                time.sleep(0.3)
            text = raises_soon(v, lambda: f(mine), f"{where}: node 1's rows failing")
            v.expect(("row too large" in text) if node == 1 else ("node(s) [1]" in text), f"{where}: {text}")
            continue
        before = inter.plan_steps
        try:
            got = f(datas[node])
        except Exception as err:  # noqa: BLE001
            v.expect(False, f"{where}: {type(err).__name__}: {err}")
            return
        planned += inter.plan_steps > before
        got = got if isinstance(got, list) else [got]
        wants = want(data)
        v.expect(len(got) == len(wants), f"{where}: {len(got)} results")
        for g, w in zip(got, wants):
            g = np.asarray(g)
            tight = np.dtype(dtype).kind == "i" or (dtype == "float64" and "avg" not in ops)
            same = np.array_equal(g, w) if tight else np.allclose(g, w, rtol=1e-5)
            v.expect(same and g.shape == np.shape(w), f"{where}: {g!r} != {w!r}")
            digests.append(zlib.crc32(g.tobytes()))
    v.info["planned_calls"] = planned
    v.info["digests"] = digests
    # the kept calls whose outputs rode the workers' answers (a node of several processes)
    v.info["inline_plans"] = sum(p.lane is not None and p.among_nodes for _, _, f, _ in cases for p in f._planned.values())
    # of them, the kept calls with a gather output (their parts gathered among the nodes by the master)
    v.info["inline_gathers"] = sum(p.lane is not None and p.among_nodes for _, ops, f, _ in cases if "gather" in ops
                                   for p in f._planned.values())


def scenario_diverge_planned(v, node, node_sizes):
    """Divergences met on the nodes' plans (``diverge_planned`` and ``diverge_node_planned``,
    see the module's docstring). Once the plans of sum and max are kept (a node of one process: the MPI plan; of
    several: its master's direct plan), node 1 changes a variable's shape, uses another
    op, skips a step, calls join() while the others step on their plans: every node
    raises (or the join semantics hold) and the next call and all_reduce agree."""
    x = pt.dmatrix("x")
    w = pytensor.shared(np.ones(3), name="w")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    synk.function([], (w.sum(), "sum"), mode=MODE, name="h")
    synk.distribute()
    data, per_node = all_rows(node_sizes)
    mine, total, s = per_node[node], sum(node_sizes), synk._state.current()
    inter = s.proc.comm.inter

    def on_plan(what, call):  # call() made its step on the node's plan
        before, generation = inter.plan_steps, s.kept.generation
        out = call()
        alone = node_sizes[node] == 1
        v.expect(inter.plan_steps == before + 1 if alone else s.kept.generation == generation,
                 f"{what}: not on the plan")
        return out

    def ones():  # every process's value ones
        w.set_value(np.ones(3))
        synk.broadcast(w)

    def keep():  # the plans of sum and max kept (a full-path step each), then one step on each
        for op in ("sum", "max", "sum", "max"):
            ones()
            synk.all_reduce(w, op)
        on_plan("sum", lambda: synk.all_reduce(w, "sum"))
        v.expect(np.array_equal(w.get_value(), np.full(3, float(total))), f"sum on the plan: {w.get_value()}")

    cases = [  # (name, what every other node does, what node 1 does, what each raises)
        ("another shape", lambda: on_plan("shape", lambda: synk.all_reduce(w, "sum")),
         lambda: (w.set_value(np.ones(4)), synk.all_reduce(w, "sum")), "ValueError"),
        ("another op", lambda: on_plan("op", lambda: synk.all_reduce(w, "sum")),
         lambda: on_plan("op", lambda: synk.all_reduce(w, "max")), "StepMismatchError"),
        ("a step skipped", lambda: on_plan("skip", lambda: synk.all_reduce(w, "sum")),
         lambda: f(mine), "StepMismatchError"),
    ]
    for name, others, ones_, error in cases:
        keep()
        text = raises_soon(v, ones_ if node == 1 else others, name)
        # (another shape on node 1 of several processes: node 1's own processes disagree
        # first, and the others raise PeerFailed naming its ValueError)
        v.expect(text.startswith(error) or (node != 1 and error == "ValueError" and node_sizes[1] > 1
                                            and text.startswith("PeerFailed") and "ValueError" in text),
                 f"{name}: {text}")
        _step_ok(v, f"the call after {name}", lambda: f(mine), data.sum(0))
        ones()
        _step_ok(v, f"all_reduce after {name}", lambda: synk.all_reduce(w, "sum") or w.get_value(),
                 np.full(3, float(total)))
    keep()
    if node == 1:  # join(): the others' steps go on over their own values, on their plans
        synk.join()
    else:
        for t in range(3):
            want = w.get_value() * (total - node_sizes[1])
            on_plan("join", lambda: synk.all_reduce(w, "sum"))
            v.expect(np.array_equal(w.get_value(), want), f"while joined ({t}): {w.get_value()} != {want}")
        synk.join()
    ones()
    _step_ok(v, "all_reduce after join", lambda: synk.all_reduce(w, "sum") or w.get_value(), np.full(3, float(total)))
    v.info["cases"] = len(cases) + 1


def scenario_avg_uneven(v, node, node_sizes):
    """An ``avg`` all_reduce too large for the header on nodes of different sizes (each
    node's part scaled by its share of the processes before MPI's sum): 0-d float32 and
    float64 variables among others, every process its own values (set_value of each global
    rank); every result close to numpy's mean over the processes, the same on every node.
    (A 0-d part's scaled copy was a numpy scalar whose flat view MPI read after it was
    freed: garbage, the same on every node, without an error.)"""
    kinds = [((), np.float32), ((), np.float64), ((3,), np.float32), ((2,), np.int32)]
    shared = [pytensor.shared(np.zeros(*kinds[i % 4]), name=f"u{i}") for i in range(40)]
    synk.function([], [(s.sum(), "sum") for s in shared], mode=MODE, name="u")
    synk.distribute()
    n = sum(node_sizes)
    rng = np.random.default_rng(7)  # the same draws on every node
    for rep in range(3):
        values = [[np.asarray(rng.normal(size=s.get_value().shape) * 10).astype(s.dtype) for s in shared]
                  for _ in range(n)]
        for r in range(n):
            synk.set_value(r, shared, values[r])
        synk.all_reduce(shared, "avg")
        for i, s in enumerate(shared):
            want = np.mean(np.stack([values[r][i] for r in range(n)]).astype(np.float64), axis=0)
            want = np.round(want) if s.dtype.startswith("int") else want
            for r in (0, n - 1):
                got = synk.get_value(r, s)
                v.expect(np.allclose(got, want, rtol=1e-5, atol=1e-4), f"rep {rep} u{i} rank {r}: {got} != {want}")
        v.info.setdefault("digests", []).append(zlib.crc32(b"".join(s.get_value().tobytes() for s in shared)))


def scenario_fold_order(v, node, node_sizes):
    """Nodes of one process each: reductions too large for the header, of values whose sum
    depends on the order (magnitudes from 1e-8 to 1e8) with a NaN on node 1, against numpy's
    fold in node order, bit for bit: ``all_reduce`` of float32 and float64 variables with
    every op, ``reduce(in_place=False)``, and a call's max, min and sum outputs, the same on
    every node. (MPI's own reductions folded in another order from 4 nodes on, and their
    MAX and MIN dropped the NaN: a number where every other path gives NaN.)"""
    n = len(node_sizes)
    assert set(node_sizes) == {1}, "nodes of one process each"
    lib = model_lib()
    rng = np.random.default_rng(11)  # the same draws on every node
    x = pt.matrix("x", dtype="float64")
    f = synk.function([x], [(x.max(axis=0), "max"), (x.min(axis=0), "min"), (x.sum(axis=0), "sum")],
                      mode=MODE, name="f")
    shared = [pytensor.shared(np.zeros(100, dtype=dt), name=f"s{dt.__name__}") for dt in (np.float64, np.float32)]
    synk.function([], [(s.sum(), "sum") for s in shared], mode=MODE, name="g")  # (the workers hold them)
    synk.distribute()
    for rep in range(3):
        parts = [(rng.standard_normal(100) * 10.0 ** rng.integers(-8, 9, size=100)) for _ in range(n)]
        parts[1][[3, 50]] = np.nan
        got = f(parts[node][None])  # (one row per node: each node's result is its row)
        for i, (op, out) in enumerate(zip(["max", "min", "sum"], got)):
            want = lib.combine(parts, op)
            v.expect(out.tobytes() == want.tobytes(), f"rep {rep}: call output {i} ({op}): {out[:6]} != {want[:6]}")
        for op in ("sum", "avg", "prod", "max", "min"):
            for s in shared:
                mine = [p.astype(s.dtype) for p in parts]
                s.set_value(mine[node])
                want = lib.reduce_collective(mine, op, s.dtype)
                res = synk.reduce(s, op=op, in_place=False)
                v.expect(res.tobytes() == want.tobytes(), f"rep {rep}: reduce {op} {s.name}: {res[:6]} != {want[:6]}")
                s.set_value(mine[node])
                synk.all_reduce(s, op=op)
                res = s.get_value()
                v.expect(res.tobytes() == want.tobytes(), f"rep {rep}: all_reduce {op} {s.name}: {res[:6]} != {want[:6]}")
    v.info["digest"] = zlib.crc32(b"".join(s.get_value().tobytes() for s in shared))


#: The scenarios that take (verdict, node, node sizes), by name.
def scenario_diverge_kept(v, node, node_sizes):
    """Broadcasts and reduces on the nodes' kept plans (``diverge_kept``, see the module's
    docstring): node 0 changes a variable's shape, node 1 changes its own copy's, node 1
    skips the step, broadcasts another variable, all-reduces instead, reduces with another
    op, in place where the others are not, or a value of another shape; node 1 joins
    while node 0 broadcasts and reduces, node 0 joins while node 1 broadcasts. Every node
    gets node 0's values (a broadcast) or every node's combined in node order (a reduce),
    or raises the same error, and the next steps agree."""
    x = pt.dmatrix("x")
    w = pytensor.shared(np.zeros(3), name="w")
    u = pytensor.shared(np.zeros(2, dtype=np.int32), name="u")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE, name="f")
    synk.function([], (w.sum() + u.sum(), "sum"), mode=MODE, name="h")
    synk.distribute()
    data, per_node = all_rows(node_sizes)
    mine, total, s = per_node[node], sum(node_sizes), synk._state.current()
    inter, alone, n = s.proc.comm.inter, node_sizes[node] == 1, len(node_sizes)
    v.expect(all(size == 1 for size in node_sizes), "diverge_kept: nodes of one process")

    def planned(what, call, want, planned=True):  # call()'s result is want (on this node's plan, where it keeps one)
        before = inter.plan_steps
        got = call()
        v.expect(got.shape == want.shape and np.array_equal(got, want), f"{what}: {got} != {want}")
        v.expect(not (planned and alone) or inter.plan_steps == before + 1, f"{what}: not on the plan")

    def bcast(want, planned_=True):
        planned("broadcast", lambda: synk.broadcast(w) or w.get_value(), want, planned_)

    def reduce(want, planned_=True):  # every node's w summed, on every node master; w as it was
        mine_ = w.get_value()
        planned("reduce", lambda: synk.reduce(w, "sum", in_place=False), want, planned_)
        v.expect(np.array_equal(w.get_value(), mine_), "reduce: the value changed")

    def own(value):  # node k holds value + 100 k
        w.set_value(value + 100.0 * node)

    def keep(t):  # both plans kept (a full-path step each), then steps on them
        want = np.arange(3.0) * (t + 1)
        for k in range(3):
            own(want)
            reduce(sum(want + 100.0 * j for j in range(n)), planned_=k > 0)
            bcast(want, planned_=k > 0)
        return want

    cases = [  # (name, what node 0 does, what node 1 does, what both raise: None for nothing)
        ("node 0's new shape", lambda want: (own(np.arange(5.0)), bcast(np.arange(5.0), False)),
         lambda want: bcast(np.arange(5.0)), None),
        ("node 1's own shape", lambda want: bcast(want),
         lambda want: (w.set_value(np.ones(4)), bcast(want, False)), None),
        ("a step skipped", lambda want: synk.broadcast(w), lambda want: f(mine), "StepMismatchError"),
        ("another variable", lambda want: synk.broadcast(w), lambda want: synk.broadcast(u), "StepMismatchError"),
        ("an all_reduce", lambda want: synk.broadcast(w), lambda want: synk.all_reduce(w, "sum"),
         "StepMismatchError"),
        ("another op", lambda want: synk.reduce(w, "sum", in_place=False),
         lambda want: synk.reduce(w, "max", in_place=False), "StepMismatchError"),
        ("in place", lambda want: synk.reduce(w, "sum", in_place=False), lambda want: synk.reduce(w, "sum"),
         "StepMismatchError"),
        ("a reduce of another shape", lambda want: synk.reduce(w, "sum", in_place=False),
         lambda want: (w.set_value(np.ones(4)), synk.reduce(w, "sum", in_place=False)), "ValueError"),
    ]
    for t, (name, first, other, error) in enumerate(cases):
        want = keep(t)
        step = first if node == 0 else other
        if error is None:
            _step_ok(v, name, lambda: (step(want), 0.0)[1], 0.0)
        else:
            text = raises_soon(v, lambda: step(want), name)
            v.expect(text.startswith(error), f"{name}: {text}")
        _step_ok(v, f"the call after {name}", lambda: f(mine), data.sum(0))
        own(np.arange(3.0) - t)
        bcast(np.arange(3.0) - t, False)
    for joins in (1, 0):  # a node joins while the other broadcasts from node 0 (and reduces)
        want = keep(len(cases) + joins)
        if node == joins:
            synk.join()
        elif joins == 1:  # node 0's own values, on its plans: the reduce is over node 0's alone
            for t in range(3):
                w.set_value(want * t)
                reduce(want * t)
                bcast(want * t)
            synk.join()
        else:
            text = raises_soon(v, lambda: synk.broadcast(w), "broadcast from a node that joined")
            v.expect(text.startswith("ValueError") and "joined" in text, f"root joined: {text}")
            synk.join()
        own(np.arange(3.0) + joins)
        bcast(np.arange(3.0) + joins, False)
        w.set_value(np.ones(3))
        _step_ok(v, f"all_reduce after node {joins} joined", lambda: synk.all_reduce(w, "sum") or w.get_value(),
                 np.full(3, float(total)))
    v.info["cases"] = len(cases) + 2


SCENARIOS = {"kill": scenario_kill, "diverge": scenario_diverge, "bad_broadcast": scenario_bad_broadcast,
             "timeout": scenario_timeout, "alone": scenario_alone_raises, "busy": scenario_busy_after_kill,
             "uneven": scenario_uneven, "join_close": scenario_join_close, "leave": scenario_leave,
             "caught": scenario_caught, "joined_collectives": scenario_joined_collectives,
             "timeout_usable": scenario_timeout_usable, "close_in_join": scenario_close_in_join,
             "refork": scenario_refork, "avg_uneven": scenario_avg_uneven, "fold_order": scenario_fold_order,
             "diverge_planned": scenario_diverge_planned, "diverge_node_planned": scenario_diverge_planned,
             "diverge_kept": scenario_diverge_kept}


def main() -> int:
    out, scenario, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    node = node_index()
    v = Verdict(out, node)
    v.info["hostname"] = __import__("socket").gethostname()
    v.info["netns"] = os.readlink("/proc/self/ns/net")
    v.info["affinity_before"] = sorted(os.sched_getaffinity(0))
    prefixes = []
    error = None
    try:
        if scenario == "fail_before_fork":  # node 1 fails while loading its data
            (v.path.parent / f"pid.{node}.txt").write_text(str(os.getpid()))
            if node == 1:
                time.sleep(2)
                raise SystemExit("node 1 failed before fork()")
            synk.fork(sizes[0], device="cpu")  # waits for MPI to start: mpirun stops it
            v.write()
            return 0
        if scenario in ("late_start", "fork_retry"):
            prefixes.append((scenario_late_start if scenario == "late_start" else scenario_fork_retry)(v, node, sizes))
            synk.close()
            (v.path.parent / f"shm.{node}.txt").write_text("\n".join(my_shm(prefixes)))
            return 0 if v.write() else 1
        synk.fork(sizes[node % len(sizes)], device="cpu", timeout={"timeout": 3.0, "timeout_usable": 2.0}.get(scenario))
        prefixes.append(synk._state.current().proc.prefix)
        v.info["affinity"] = sorted(os.sched_getaffinity(0))
        node_sizes = check_identity(v, node, sizes, synk.world())
        if scenario in ("ops", "count"):
            check_outputs(v, node, node_sizes)
            if scenario == "ops":
                check_collectives(v, node, node_sizes)
                check_worker_raises(v, node, node_sizes)
            check_mismatch(v, node, "count" if len(node_sizes) > 2 or scenario == "count" else "graph")
        elif scenario.startswith("random"):  # random:<seed>:<count>
            _, seed, count = scenario.split(":")
            scenario_random(v, node, node_sizes, int(seed), int(count))
        elif scenario.startswith("planned_calls:"):  # planned_calls:<seed>
            scenario_planned_calls(v, node, node_sizes, int(scenario.split(":")[1]))
        elif scenario.startswith("node_planned:"):  # node_planned:<seed>
            scenario_node_planned(v, node, node_sizes, int(scenario.split(":")[1]))
        elif scenario.startswith("timeout_planned:"):  # timeout_planned:<late node, or close>
            scenario_timeout_planned(v, node, node_sizes, scenario.split(":")[1])
        elif scenario.startswith("planned:"):  # planned:<seed>
            scenario_planned(v, node, node_sizes, int(scenario.split(":")[1]))
        elif scenario in SCENARIOS:
            SCENARIOS[scenario](v, node, node_sizes)
        elif scenario in ("raise", "sigkill"):
            scenario_master_fails(v, node, node_sizes, scenario, out)
        s = synk._state.current()
        inter = None if s is None else getattr(s.proc.comm, "inter", None)
        v.info["plan_steps"] = None if inter is None else inter.plan_steps
    except BaseException as err:  # noqa: BLE001
        if scenario == "raise" and node == 1:
            v.write()
            raise  # uncaught, no close(): the exit path tells the other nodes
        error = err
    synk.close()
    (v.path.parent / f"shm.{node}.txt").write_text("\n".join(my_shm(prefixes)))
    ok = v.write(error)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
