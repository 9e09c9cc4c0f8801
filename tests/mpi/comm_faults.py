"""A node that fails in the middle of a collective: every node raises within
seconds, none waits for ever (run under mpirun by tests/test_mpi_comm.py).

    mpirun -np 3 python tests/mpi/comm_faults.py OUT_DIR MODE

MODE:
  notice  node 2's ``check()`` raises while it waits in an all_reduce that
          node 1 has not entered yet (as when a worker of node 2 dies): node 2
          raises that error and tells the others; node 0, waiting in the same
          all_reduce, raises NodeFailedError naming node 2 and the reason; node
          1 raises the same at its next call. Then every node closes and
          finalises MPI cleanly.
  die     node 1 ends (os._exit) inside a collective; mpirun runs with
          --enable-recovery so it does not stop the job: the others learn of it
          from ``check()`` alone, which here looks for the peers' processes (in
          the runtime, a node master's ``check`` is its session's liveness
          check; a master that dies is reported by mpirun, see ``term``).
  term    node 1 ends inside a collective under a plain mpirun, which then
          stops the job with SIGTERM: the others, polling, run their Python
          handler (which raises here) and end within seconds.

Each surviving rank writes what it raised and after how long to its verdict. In
``notice`` and ``die`` a kept plan (MpiCommunicator.plan) makes a step before the
failure; after it, the plan's next step is numbered, then raises.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from common import Verdict, init_mpi

DELAY = 0.3     # how long the failing node waits in the collective before failing
PAYLOAD = 1 << 20


class Terminated(Exception):
    """SIGTERM, raised by this script's handler."""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def main() -> int:
    out, mode = sys.argv[1], sys.argv[2]
    MPI = init_mpi()
    from synkhronos.collectives.mpi import MpiCommunicator, NodeFailedError

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    v = Verdict(out, rank)
    v.info["mode"] = mode
    Path(out, f"pid.{rank}").write_text(str(os.getpid()))
    state = {"fail_at": None, "pids": {}}

    def check():
        if state["fail_at"] is not None and time.perf_counter() >= state["fail_at"]:
            raise RuntimeError(f"worker rank 1 of node {rank} died (simulated)")
        for r, pid in state["pids"].items():
            if not alive(pid):
                raise RuntimeError(f"node {r} (pid {pid}) is gone")

    if mode == "term":
        def on_term(signum, frame):
            raise Terminated(f"signal {signum}")
        signal.signal(signal.SIGTERM, on_term)
    comm = MpiCommunicator(world, 0, check)
    comm.barrier()  # every pid file is written
    if mode == "die":
        state["pids"] = {r: int(Path(out, f"pid.{r}").read_text()) for r in range(size) if r != rank}
    data = [np.full(PAYLOAD, rank, dtype=np.float64)]
    got = comm.all_reduce(data, "sum")  # a good one first
    v.expect(float(got[0][0]) == sum(range(size)), "a collective before the failure")
    plan = comm.plan("all_reduce", [(np.dtype(np.float64), (2,))], "sum", (("faults",), "a planned step"))
    small = [np.full(2, float(rank))]
    v.expect(plan is not None and plan.run(small) and float(small[0][0]) == sum(range(size)),
             "a kept plan's step before the failure")
    start = time.perf_counter()
    try:
        if mode == "notice":
            if rank == 1:
                time.sleep(DELAY + 1.0)   # enters late: the notice is already there
            if rank == 2:
                state["fail_at"] = start + DELAY
            comm.all_reduce(data, "sum")
        else:
            if rank == 1:
                time.sleep(DELAY)
                os._exit(3)
            comm.all_reduce(data, "sum")
        v.info["raised"] = None
    except NodeFailedError as exc:
        v.info.update(raised="NodeFailedError", node=exc.node, reason=exc.reason, message=str(exc))
    except BaseException as exc:  # noqa: BLE001 - what this node raised is the verdict
        v.info.update(raised=type(exc).__name__, message=str(exc))
    v.info["elapsed"] = time.perf_counter() - start
    v.info["broken"] = comm.broken
    if mode != "term":  # the plan's next step is numbered before it raises (as every step is)
        begun = comm.begun
        try:
            plan.run([np.zeros(2)])
            v.info["plan_after"] = "no error"
        except Exception as exc:  # noqa: BLE001 - what it raised is the verdict
            v.info["plan_after"] = f"{type(exc).__name__}: {exc}"
        v.expect(comm.begun == begun + 1 and v.info["plan_after"].split(":")[0] in ("SynkError", "NodeFailedError"),
                 f"a planned step after the failure: numbered ({comm.begun - begun}), then raised "
                 f"({v.info['plan_after']})")
    if mode == "term":  # mpirun's SIGKILL follows its SIGTERM closely: the verdict first, nothing else
        v.expect(v.info["raised"] is not None, "the collective raised")
        v.write()
        os._exit(0)
    try:
        comm.barrier()
        v.info["after"] = "no error"
    except Exception as exc:  # noqa: BLE001
        v.info["after"] = f"{type(exc).__name__}: {exc}"
    v.expect(v.info["raised"] is not None, "the collective raised")
    comm.close()
    v.info["closed"] = True
    ok = v.write()
    if mode == "die":
        # stay until the other survivors have their verdicts: one that left
        # first would look to a slower one's check() like a dead node
        others = [Path(out, f"verdict.{r}.json") for r in range(size) if r not in (rank, 1)]
        end = time.monotonic() + 20.0
        while not all(p.exists() for p in others) and time.monotonic() < end:
            time.sleep(0.01)
        os._exit(0)        # a peer is gone: no MPI_Finalize
    MPI.Finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
