"""What every script under tests/mpi/ shares: MPI started as a node master
starts it (after any fork, never at import), a verdict file per rank, and
numpy's own answers to compare with.

Scripts here run under ``mpirun`` from tests/test_mpi_comm.py; each rank
writes ``<out>/verdict.<rank>.json`` and exits non-zero when a check failed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # this checkout's synkhronos, wherever it runs from


def init_mpi():
    """``MPI`` initialised as the runtime does it: not at import, then Init_thread."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    MPI.Init_thread(MPI.THREAD_SERIALIZED)
    return MPI


class Verdict:
    """Counts checks, keeps the first failures, writes ``verdict.<rank>.json``."""

    def __init__(self, out: str, rank: int):
        self.path = Path(out) / f"verdict.{rank}.json"
        self.rank = rank
        self.checks = 0
        self.failures: list[str] = []
        self.info: dict = {}
        self.start = time.perf_counter()
        # a rank that hangs prints where, and ends (the test bounds mpirun too)
        faulthandler.dump_traceback_later(float(os.environ.get("SYNK_MPI_TEST_LIMIT", "60")), exit=True)

    def expect(self, cond, what: str) -> None:
        self.checks += 1
        if not cond:
            self.failures.append(what)

    def write(self, error: BaseException | None = None) -> bool:
        if error is not None:
            self.failures.append("".join(traceback.format_exception(error)))
        ok = not self.failures and self.checks > 0
        data = {"rank": self.rank, "ok": ok, "checks": self.checks, "failures": self.failures[:20],
                "seconds": time.perf_counter() - self.start, **self.info}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.path)
        return ok


def result_dtype(dtype, op) -> np.dtype:
    """What every path returns: avg of integers and booleans is float64."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float64) if op == "avg" and dtype.kind in "biu" else dtype


def model_lib():
    """tests/model_lib.py (numpy's recipes of the documented combinations), imported when
    first needed: it imports PyTensor and the tests' conftest."""
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))
    import model_lib as lib

    return lib


def expected_reduce(parts, op, weights=None):
    """numpy's answer for ``op`` over the present ``parts`` (weights for avg)."""
    stack = np.stack(parts)
    dtype = stack.dtype
    if op == "avg":
        w = np.ones(len(parts)) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.sum() <= 0:
            w = np.ones(len(parts))
        # the documented combination, as tests/model_lib.py writes it out (equal weights: the
        # sum in order times the reciprocal of the count; unequal: each part times its share of
        # the total, in order): an integer avg rounds what that gives (another formula of the
        # same mean rounded some .5 the other way at 4 nodes)
        return model_lib().combine(parts, "avg", w)
    if dtype.kind == "b":
        fn = np.any if op in ("sum", "max") else np.all
        return np.asarray(fn(stack, axis=0))
    fn = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op]
    if op in ("max", "min") and dtype.kind == "c":  # numpy's order of complex numbers
        ufunc = np.maximum if op == "max" else np.minimum
        return np.asarray(ufunc.reduce(stack, axis=0))
    if op in ("sum", "prod"):
        return np.asarray(fn(stack, axis=0, dtype=dtype))  # integers wrap, as in MPI
    return np.asarray(fn(stack, axis=0))


def close_enough(got, want) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if want.dtype.kind in "fc":
        tol = 1e-5 if want.dtype in (np.float32, np.complex64) else 2e-3 if want.dtype == np.float16 else 1e-12
        return bool(np.allclose(got, want, rtol=tol, atol=tol))
    return bool(np.array_equal(got, want))


def conclude(v: Verdict, MPI, comm=None, error: BaseException | None = None) -> int:
    """The end of a script: tell the other ranks of ``error`` (their waits raise instead
    of hanging), write the verdict, finalise MPI; the exit status."""
    if error is not None and comm is not None:
        comm.abort(f"{type(error).__name__}: {error}")
    ok = v.write(error)
    MPI.Finalize()
    return 0 if ok else 1
