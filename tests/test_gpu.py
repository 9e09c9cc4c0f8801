"""The GPU device.

Tests marked ``gpu`` need a GPU and the GPU stack (CuPy and JAX with CUDA);
they skip with the reason where either is missing. Each GPU scenario runs in
a fresh Python process (tests/gpu_scenarios.py): this pytest process never
initialises CUDA, or it could not fork GPU workers afterwards.

The other tests run anywhere: the package imports without the stack, asking
for a GPU without one is a clear error, ``device="auto"`` falls back to the
CPU, and, where JAX is installed (a CPU build is enough), the GPU scenarios
run against the CuPy stand-in of tests/fakegpu and JAX's CPU device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos import _state, devices, gpu, _runtime as runtime
from synkhronos.devices import gpu_stack

from conftest import run_python

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "gpu_scenarios.py"
FAKE = ROOT / "tests" / "fakegpu"


def _no_gpu_reason() -> str | None:
    """Why the GPU tests cannot run here (None when they can); CUDA starts only in a subprocess."""
    missing = gpu.stack_missing()
    if missing:
        return f"the GPU stack is not installed ({' and '.join(missing)} missing): pip install synkhronos[gpu]"
    found = gpu.probe()
    if found.missing:
        return f"the GPU stack does not import: {found.missing}"
    if found.n_gpus < 1:
        return f"no GPU is visible ({found.error or 'CuPy counts no device'})"
    return None


NO_GPU = _no_gpu_reason()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
HAS_JAX = importlib.util.find_spec("jax") is not None
needs_jax = pytest.mark.skipif(not HAS_JAX, reason="needs jax (a CPU build is enough): the CPU "
                                                   "test requirements do not include it")


def scenario(name: str, n: int, fake: bool = False, timeout: float = 280) -> dict:
    """Run a scenario of tests/gpu_scenarios.py in a fresh process; its facts."""
    cmd = [sys.executable, str(SCRIPT), name, str(n)] + (["--fake"] if fake else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    out = done.stdout.strip().splitlines()
    assert done.returncode == 0 and "OK" in out, (
        f"scenario {name} with {n} processes failed (exit {done.returncode}):\n"
        f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return json.loads(out[-1])


# ---------------------------------------------------------------------------
# On a GPU machine.


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gpu_scenario(n):
    """1 process: a real one-rank NCCL communicator through every collective and output
    op; more processes than GPUs share them over the CPU collectives. Results equal
    as_pytensor on the same device, in the graph's dtypes (float16 to int64, every op
    and path); shared variables stay on the device. The scenarios outputs, shareds and
    dtypes share one fork: the GPU starts once in each process."""
    facts = scenario("contract", n)
    assert facts["nccl"] == (n <= gpu.count_gpus())


@pytest.mark.gpu
@needs_gpu
def test_gpu_planned_scenario():
    """The stand-in's planned scenario on a GPU, where np.asarray caches a host copy
    (a value with one is never written in place) and JAX runs on its own stream."""
    facts = scenario("planned", 1)
    assert facts["in_place"] > 0 and facts["plan_runs"] > 0 and facts["host_copies"] > 0, facts
    # reported, not asserted: whether a host copy begun by copy_to_host_async() (before
    # np.asarray caches it) misses a later write in place
    print("async host copy goes stale:", facts["async_host_copy_goes_stale"])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [1, 2])
def test_gpu_fork_again_after_close(n):
    scenario("refork", n)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [2, 3])
def test_gpu_worker_killed_during_calls(n):
    """Processes sharing the GPU do not each take most of its memory; a worker killed
    while calls run is a WorkerDiedError within seconds, and close() frees everything."""
    facts = scenario("killed", n)
    assert facts["noticed_after_s"] < 10


# ---------------------------------------------------------------------------
# Anywhere JAX is installed: the same scenarios on the CuPy stand-in.


@needs_jax
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow), 2,
                               pytest.param(3, marks=pytest.mark.slow)])
def test_gpu_scenario_on_fake_gpu(n):
    """outputs, shareds and dtypes in one fork: every op and collective keeps the graph's
    dtype (a float32 avg came back float64 before issue 45's fix)."""
    facts = scenario("contract", n, fake=True)
    assert facts["nccl"] == (n == 1)


@needs_jax
@pytest.mark.parametrize("n", [2])  # forks one process twice, then two are refused: n=1 and more
def test_fork_again_after_close_on_fake_gpu(n):
    scenario("refork", n, fake=True)


@needs_jax
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_worker_killed_during_calls_on_fake_gpu(n):
    facts = scenario("killed", n, fake=True)
    assert facts["noticed_after_s"] < 10


@needs_jax
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_planned_scenario_on_fake_gpu(seed):
    """One process, a seeded random sequence of all_reduces (every op, float32 to
    complex64 and bool, 0-d to 2-d), calls with updates, set_value, get_value,
    np.asarray and variables holding one array, against a numpy model after every
    step: NCCL writes the values in place (no conversion), the communicator's kept
    plan runs, and an array two variables hold is never written."""
    facts = scenario("planned", seed, fake=True)
    assert facts["in_place"] > 0 and facts["plan_runs"] > 0 and facts["held_twice"] > 0, facts


@needs_jax
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_planned_calls_on_fake_gpu(n):
    """Calls (planned from the second) with numpy and with device outputs against numpy,
    seeded random rows: every op, float32 (kept float32) to int64, 0-d to (7, 3) per row;
    and outputs that are an input, a shared value (also after ``updates=[(b, a)]``), an
    update's new value or one array twice, as a forwarding JAX gives them: inputs and shared values unchanged;
    and outputs whose shapes change between planned calls (``set_value``, a growing update): the
    kept output reduction is never used for another layout (each reduce's count is the output's).
    With one process (NCCL on the stand-in) the ordinary outputs are reduced in place
    on their own buffers and the forwarded ones never are. On 2 and 3 (make test-slow) the
    outputs go through shared memory (the stand-in's NCCL works within one process only),
    which test_gpu_scenario_on_fake_gpu[2] covers in make test."""
    facts = scenario("calls", n, fake=True)
    assert facts["cases"] == 48 and facts["forwarded"] == 4 and facts["layouts"] == 10, facts
    assert facts["nccl"] == (n == 1), facts
    if n == 1:
        assert facts["in_place"] == facts["reduces"] > 0, facts
        assert facts["forwarded_in_place"] == 0 and facts["forwarded_reduces"] == 24, facts
        # the kept output reduction ran, and refused the outputs whose layout had changed
        assert facts["kept_runs"] > 0 and facts["kept_refused"] > 0, facts


@needs_jax
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow), 2,
                               pytest.param(3, marks=pytest.mark.slow)])
def test_jax_mode_on_cpu_workers(n):
    """mode="JAX" on the CPU device: JAX arrays in every process, CPU collectives."""
    facts = scenario("jax_cpu", n)
    assert facts["as_pytensor output types"] == ["ArrayImpl"]


# ---------------------------------------------------------------------------
# Anywhere.


def _shim(root: Path, name: str, body: str) -> Path:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(body))
    return root


@pytest.mark.parametrize("preset", [None, "cuda"])
@pytest.mark.parametrize("jax_first", [False, True])
def test_cpu_workers_keep_jax_on_the_cpu(preset, jax_first):
    """A worker of the CPU device runs JAX on the CPU unless the user named JAX_PLATFORMS
    (on an H100, fork(2, device="cpu") with mode="JAX" lost its second worker: each
    process opened the GPU and took 75% of its memory)."""
    if jax_first and not HAS_JAX:
        pytest.skip("needs jax")
    done = run_python(f"""
        import os
        {"import jax" if jax_first else ""}
        from synkhronos.devices.cpu import CpuDevice
        CpuDevice().bind(1)
        print(os.environ.get("JAX_PLATFORMS"))
        {"print(jax.config.jax_platforms)" if jax_first else "print(os.environ['JAX_PLATFORMS'])"}
    """, JAX_PLATFORMS=preset or "")
    assert done.returncode == 0, done.stderr
    want = preset or "cpu"
    assert done.stdout.split() == [want, want], done.stdout


@needs_jax
def test_workers_refuse_jax_started_before_fork():
    """JAX running in the master before fork(): a worker's JAX-mode function is a clear error
    from that worker, not an abort (SIGABRT, "Mutex::Fer while waiting") or a hang."""
    done = run_python("""
        import warnings
        warnings.simplefilter("ignore")
        import numpy as np
        import jax.numpy as jnp
        float(jnp.ones(3).sum())  # JAX's CPU backend starts in the master
        import pytensor.tensor as pt
        import synkhronos as synk
        synk.fork(2, device="cpu")
        x = pt.dvector("x")
        c = synk.function([x], (pt.sum(x), "sum"), mode="FAST_COMPILE")
        f = synk.function([x], (pt.sum(x), "sum"), mode="JAX")
        try:
            synk.distribute()
            f(np.ones(6))
        except RuntimeError as err:
            print("RAISED", type(err).__name__, err)
        synk.close()
    """, JAX_PLATFORMS="cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RAISED RuntimeError" in done.stdout and "JAX was already running in the master" in done.stdout, \
        done.stdout + done.stderr[-3000:]


def test_package_imports_without_cupy_or_jax(tmp_path):
    """Even with cupy and jax that fail to import, synkhronos imports and never tries them."""
    shims = _shim(tmp_path, "cupy", "raise ImportError('shim: no cupy here')")
    _shim(shims, "jax", "raise ImportError('shim: no jax here')")
    done = run_python("""
        import sys
        import synkhronos, synkhronos.gpu, synkhronos.devices.gpu, synkhronos.collectives.nccl
        from synkhronos.collectives import BACKENDS
        assert 'cupy' not in sys.modules and 'jax' not in sys.modules, sorted(sys.modules)
        assert sorted(BACKENDS) == ['mpi', 'nccl', 'shm'] and 'mpi4py' not in sys.modules
        print('imported')
    """, [shims])
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr


def test_gpu_without_the_stack_names_what_to_install(tmp_path):
    """cupy and jax are found but fail to import (in the probe subprocess too)."""
    shims = _shim(tmp_path, "cupy", "raise ImportError('shim: libcudart.so.13 not found')")
    _shim(shims, "jax", "raise ImportError('shim: no jax here')")
    done = run_python("""
        import synkhronos as synk
        try:
            synk.fork(device="gpu")
        except RuntimeError as err:
            print("ERROR:", err)
        else:
            print("forked")
    """, [shims])
    assert done.returncode == 0, done.stderr
    assert "ERROR: device='gpu' needs cupy and jax, which could not be imported" in done.stdout
    assert "libcudart.so.13 not found" in done.stdout
    assert done.stdout.rstrip().endswith("pip install synkhronos[gpu]"), done.stdout


def test_gpu_with_the_stack_but_no_gpu_says_so(tmp_path):
    """CuPy (the stand-in) imports but counts no device: no GPU is visible; auto uses the CPU."""
    paths = [FAKE]
    if not HAS_JAX:
        paths.append(_shim(tmp_path, "jax", "# an importable jax: the probe only imports it"))
    done = run_python("""
        import synkhronos as synk
        from synkhronos import _runtime as runtime
        try:
            synk.fork(device="gpu")
        except RuntimeError as err:
            print("ERROR:", err)
        n = synk.fork(2, device="auto")
        print("AUTO:", runtime.running_session().proc.device.name, n)
        synk.close()
    """, paths, FAKE_CUPY_GPUS="0", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr
    assert "ERROR: device='gpu' but no GPU is visible with CUDA_VISIBLE_DEVICES=''" in done.stdout
    assert "AUTO: cpu 2" in done.stdout


def test_missing_stack_in_this_process_is_named(monkeypatch):
    monkeypatch.setattr(gpu_stack, "stack_missing", lambda: ["cupy"])
    with pytest.raises(RuntimeError, match=r"^device='gpu' needs cupy, which could not be imported: "
                                           r"pip install synkhronos\[gpu\]$"):
        synk.fork(2, device="gpu")


def test_no_gpu_per_the_probe(monkeypatch):
    monkeypatch.setattr(gpu_stack, "stack_missing", lambda: [])
    monkeypatch.setattr(gpu_stack, "probe", lambda refresh=False: gpu_stack.Probe(0, {}, "cudaErrorNoDevice"))
    with pytest.raises(RuntimeError, match=r"device='gpu' but no GPU is visible.*cudaErrorNoDevice"):
        synk.fork(2, device="gpu")
    assert synk.fork(2, device="auto") == 2
    assert runtime.running_session().proc.device.name == "cpu" and runtime.running_session().proc.device.comm is None
    synk.close()


def test_auto_warns_once_that_several_gpus_are_unvalidated(monkeypatch):
    """device="auto" picking more GPUs than the path has run on (one) warns once per process
    and names both choices; one GPU, device="gpu" or the original's use_gpu=True: no warning."""
    monkeypatch.setattr(_state, "warned", set())
    monkeypatch.setattr(devices.GpuDevice, "units", classmethod(lambda cls, required: 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.choose("auto", None) == (devices.GpuDevice, 1)   # validated on one GPU
    monkeypatch.setattr(devices.GpuDevice, "units", classmethod(lambda cls, required: 2))
    with pytest.warns(UserWarning, match=r"^device='auto' chose 2 GPUs: .* has run on one GPU .* NCCL "
                                         r"across several GPUs has not yet been validated on real GPUs\. "
                                         r"Pass device='gpu' .* or device='cpu'"):
        assert devices.choose("auto", None) == (devices.GpuDevice, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.choose("auto", None) == (devices.GpuDevice, 2)   # once per process
        monkeypatch.setattr(_state, "warned", set())
        assert devices.choose("gpu", None) == (devices.GpuDevice, 2)
        assert devices.choose("auto", True) == (devices.GpuDevice, 2)
        monkeypatch.setattr(devices.GpuDevice, "units", classmethod(lambda cls, required: 0))
        assert devices.choose("auto", None) == (devices.CpuDevice, 0)   # no GPU: nothing to say


@pytest.mark.slow
def test_auto_warning_with_the_fake_gpu_stack(tmp_path):
    """With the CuPy stand-in counting two GPUs (and an importable jax), the real probe finds
    them and auto warns once, at the caller's line; one GPU, or none, says nothing."""
    paths = [FAKE]
    if not HAS_JAX:
        paths.append(_shim(tmp_path, "jax", "# an importable jax: the probe only imports it"))
    code = """
        import warnings
        from synkhronos import devices
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = devices.choose("auto", None)
            second = devices.choose("auto", None)
        print("CHOSE:", first[0].__name__, first[1], second[0].__name__)
        for w in caught:
            print("WARNING:", w.filename, str(w.message)[:40])
    """
    done = run_python(code, paths, FAKE_CUPY_GPUS="2", CUDA_VISIBLE_DEVICES="0,1")
    assert done.returncode == 0, done.stderr
    assert "CHOSE: GpuDevice 2 GpuDevice" in done.stdout
    assert done.stdout.count("WARNING:") == 1, done.stdout
    assert "WARNING: <string> device='auto' chose 2 GPUs" in done.stdout, done.stdout
    done = run_python(code, paths, FAKE_CUPY_GPUS="1", CUDA_VISIBLE_DEVICES="0")
    assert done.returncode == 0, done.stderr
    assert "CHOSE: GpuDevice 1 GpuDevice" in done.stdout and "WARNING:" not in done.stdout, done.stdout
    done = run_python(code, paths, FAKE_CUPY_GPUS="0", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr
    assert "CHOSE: CpuDevice 0 CpuDevice" in done.stdout and "WARNING:" not in done.stdout, done.stdout


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present here")
def test_auto_falls_back_to_cpu_here():
    assert synk.fork(1, device="auto") == 1
    s = runtime.running_session()
    assert s.proc.device.name == "cpu"
    synk.close()


def test_probing_does_not_import_the_stack_here():
    before = {m for m in ("cupy", "jax") if m in sys.modules}
    gpu.count_gpus()
    gpu.gpu_available()
    assert {m for m in ("cupy", "jax") if m in sys.modules} == before


def test_plan_binds_rank_r_to_gpu_r_mod_n(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = gpu_stack.plan(2, 3)
    assert p.visible == ("0", "1") and not p.nccl
    assert [p.gpu_of(r) for r in range(3)] == ["0", "1", "0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    p = gpu_stack.plan(2, 2)
    assert p.visible == ("3", "5") and p.nccl and p.gpu_of(1) == "5"


def test_bind_sets_and_unbind_restores_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setattr(_state, "bound_gpu", None)
    saved = gpu_stack.bind(gpu_stack.plan(2, 2), 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    gpu_stack.unbind(saved)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ


def test_gpu_keywords_on_the_cpu_device(fork):
    fork(2)
    x = pt.dvector("x")
    with pytest.raises(TypeError, match="nccl must be True or False, got 'no'"):
        synk.function([x], pt.sum(x), nccl="no")
    v = pytensor.shared(np.ones(3), name="v")
    f = synk.function([x], (pt.sum(x) + pt.sum(v), "sum"), nccl=False, mode="FAST_COMPILE")
    got = f(np.arange(5.0), device_outputs=True)  # on a CPU device: numpy either way
    assert isinstance(got, np.ndarray) and got == 16.0
    assert f._spec.kwargs["mode"] == "FAST_COMPILE" and not f._spec.nccl
    with pytest.raises(TypeError, match="device_outputs must be True or False, got 1"):
        f(np.arange(5.0), device_outputs=1)
    with pytest.raises(RuntimeError, match=r"on_device\(\) needs a GPU device"):
        gpu.on_device(v)


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present here: the benchmark would run")
def test_gpu_bench_without_a_gpu_says_why():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stdout.startswith("gpu_bench: ") and "nothing measured" in done.stdout
