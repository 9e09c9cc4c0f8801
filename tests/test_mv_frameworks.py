"""Keras 3 (``keras_ext.MVCallback``) and PyTorch (``torch_ext.TorchParamManager``) on the tables.

Each job runs tests/mv/frameworks.py with 2 workers, forked or under
``mpirun -np 2``, with a sync or an async server: it trains a small Keras
model (PyTorch backend, CPU) and a small PyTorch model, checks after every
sync (sync server) or at the end (async server) that every worker holds the
same weights and that they are what the delta rule predicts, and (sync
jobs) checks the bad arguments. One job imports Keras and PyTorch once.
Skipped, with the reason, without Keras 3 or PyTorch (``pip install -e '.[test]'``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from mv.runner import HERE, MPIRUN, ROOT, run

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None
                       or importlib.util.find_spec("keras") is None,
                       reason="needs PyTorch and Keras 3 (pip install -e '.[test]')"),
]

SCRIPT = HERE / "frameworks.py"
ENV = {"KERAS_BACKEND": "torch"}
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or not os.access(MPIRUN, os.X_OK),
    reason=f"needs mpi4py and Open MPI's mpirun at {MPIRUN} (pip install -e '.[mpi-wheel]')")


def passed(r, parts, n=2):
    assert r.rc == 0, f"exit status {r.rc}:\n{r.output[-4000:]}"
    for part in parts:
        ranks = sorted(int(m) for m in re.findall(rf"PASS {part} rank (\d+) of {n}", r.output))
        assert ranks == list(range(n)), f"PASS {part} lines from ranks {ranks}:\n{r.output[-4000:]}"
    assert r.leftovers == [], f"left in /dev/shm: {r.leftovers}"
    assert r.stragglers == [], f"processes left: {r.stragglers}"


# the async server's run is slow (make test-slow); make test keeps the sync one, and the async
# server's tables in test_multiverso.py
@pytest.mark.parametrize("server", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_keras_and_torch_forked(server):
    """Forked, 2 workers: tensors in and out of tables, Keras MVCallback (freq 2 with the sync
    server, 1 with async), TorchParamManager (freq 1 / 2), and the bad arguments (sync)."""
    parts = ["tensors", "keras", "torch"] + (["errors"] if server == "sync" else [])
    passed(run([server, 2], script=SCRIPT, env=ENV, timeout=150), parts)


@pytest.mark.slow  # make test keeps Keras on PyTorch, forked and under mpirun
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs JAX (pip install jax)")
def test_keras_on_the_jax_backend_forked():
    """Keras on JAX, whose fit() keeps the trained state apart from the model: the callback
    attaches it before each sync (without that, syncs read purged weights)."""
    passed(run(["sync", 2], script=SCRIPT, env={"KERAS_BACKEND": "jax"}, timeout=150),
           ["tensors", "keras", "torch", "errors"])


@needs_mpi
# (make test-slow and make test-nodes: make test runs the forked telling)
@pytest.mark.parametrize("server", [pytest.param("sync", marks=pytest.mark.slow),
                                    pytest.param("async", marks=pytest.mark.long)])
def test_keras_and_torch_under_mpirun(server):
    """The same under ``mpirun -np 2`` (tables in MPI windows), with the other freq values."""
    parts = ["tensors", "keras", "torch"] + (["errors"] if server == "sync" else [])
    passed(run([server, 0], script=SCRIPT, env=ENV, mpi=2, timeout=170), parts)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **env), timeout=120)


def test_clear_import_errors_without_the_frameworks():
    """Without Keras, with Keras but not its backend, and without PyTorch: an ImportError that
    names what to install (sys.modules[name] = None hides an installed package)."""
    no_keras = _python("import sys; sys.modules['keras'] = None\n"
                       "import synkhronos.multiverso.keras_ext")
    assert "ImportError: synkhronos.multiverso.keras_ext needs Keras 3: pip install " \
           "'synkhronos[keras]'" in no_keras.stderr, no_keras.stderr[-2000:]
    no_backend = _python("import sys; sys.modules['torch'] = None\n"
                         "import synkhronos.multiverso.keras_ext", KERAS_BACKEND="torch")
    assert "Keras is installed but its backend could not be imported" in no_backend.stderr, \
        no_backend.stderr[-2000:]
    assert "set KERAS_BACKEND to an installed backend" in no_backend.stderr
    no_torch = _python(
        "import sys; sys.modules['torch'] = None\n"
        "from synkhronos.multiverso.torch_ext import TorchParamManager\n"
        "try:\n    TorchParamManager(object())\n"
        "except ImportError as e:\n    print('A', e)\n"
        "import synkhronos.multiverso as mv\n"
        "mv.init(num_workers=1)\n"
        "t = mv.ArrayTableHandler(2)\n"
        "try:\n    t.get(as_tensor=True)\n"
        "except ImportError as e:\n    print('B', e)\n"
        "print('numpy', t.get().tolist())\n"
        "mv.shutdown()\n")
    assert no_torch.returncode == 0, no_torch.stderr[-2000:]
    assert "A TorchParamManager needs PyTorch: pip install 'synkhronos[torch]'" in no_torch.stdout
    assert ("B ArrayTableHandler.get(): as_tensor=True needs PyTorch: pip install "
            "'synkhronos[torch]'") in no_torch.stdout
    assert "numpy [0.0, 0.0]" in no_torch.stdout
