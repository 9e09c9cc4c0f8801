"""Run a multiverso scenario script in its own process tree and check what it leaves behind.

The SPMD model (every worker runs the rest of the script) makes scripts the
natural unit: each run is bounded by a timeout, tagged with a unique token on
its command line, and afterwards no process with that token and no name
``synk.<pid of the script>.`` in /dev/shm may remain.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MPIRUN = Path(sys.executable).parent / "mpirun"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


@dataclass
class Run:
    rc: int
    output: str
    seconds: float
    leftovers: list
    stragglers: list


def _with_token(token: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if token.encode() in fh.read():
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def _shm(pid: int) -> list[str]:
    tag = f"synk.{pid}."
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(tag) or e.startswith("sem." + tag))


def run(args, timeout: float = 60, mpi: int = 0, env=None, script=HERE / "scenarios.py",
        osc: str = "^ucx") -> Run:
    """``python script *args`` (or under ``mpirun -np mpi``, one-sided component ``osc``);
    the script's pid names its segments."""
    token = "mvtok" + secrets.token_hex(6)
    cmd = [sys.executable, str(script), *map(str, args), token]
    full_env = dict(os.environ, **(env or {}))
    if mpi:
        cmd = [str(MPIRUN), "-np", str(mpi), "--oversubscribe", "--bind-to", "none",
               "--mca", "osc", osc, *cmd]
        full_env.update(MPI_ENV)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=full_env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[runner: killed after {timeout} s]"
    seconds = time.monotonic() - start
    # a killed master's workers end on their own (parent-death signal): give them a moment
    end = time.monotonic() + 5
    while _with_token(token) and time.monotonic() < end:
        time.sleep(0.05)
    stragglers = _with_token(token)
    for pid in stragglers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    leftovers = [] if mpi else _shm(proc.pid)
    return Run(proc.returncode, output, seconds, leftovers, stragglers)
