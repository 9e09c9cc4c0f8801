#!/bin/bash
# The GPU validation of docs/gpu-validation.rst, as one command for the device machine:
#   bash tests/gpu_validate.sh [STEPS]     (STEPS: any of env,gpu,bench,demo,democpu,suite; default env,gpu,bench,demo,democpu)
# Installs the carried wheels (.whl) into /tmp/site, then writes every log under $OUT (or ./gpu-out).
# Each step has its own time limit, so one that hangs cannot eat the others' time; a step cut
# short still shows every failure it had (SYNK_FAILURES_LOG, see tests/conftest.py).
# GPU_S/GPU_N/GPU_K and SUITE_S/SUITE_N/SUITE_TEST_S: limits, pytest-xdist workers, -k filter.
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
STEPS=${1:-env,gpu,bench,demo,democpu}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
step() { [[ ",$STEPS," == *",$1,"* ]]; }
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"; }
if step env; then
  stamp env
  { date -u; uname -r; nvidia-smi; nvidia-smi -L; nproc; lscpu | grep -m1 'Model name'
    python3 -c "import sys,numpy,jax,cupy,pytensor; from cupy.cuda import nccl; print(sys.version); print('numpy', numpy.__version__, 'jax', jax.__version__, jax.devices(), 'cupy', cupy.__version__, 'nccl', nccl.get_version(), 'pytensor', pytensor.__version__)"
    python3 -c "import mpi4py, torch, sklearn; print('mpi4py', mpi4py.__version__, 'torch', torch.__version__, 'sklearn', sklearn.__version__)"
    which mpirun; } > "$OUT/env.txt" 2>&1
  tail -5 "$OUT/env.txt"
fi
# pytest under a step's limit: SIGINT first (pytest then prints its summary), SIGKILL 20 s later;
# every failure's traceback is also written to $2 the moment it happens (tests/conftest.py).
limited() { local limit=$1 log=$2; shift 2; : > "$log"
  SYNK_FAILURES_LOG=$log timeout -s INT -k 20 "$limit" python3 -m pytest -p no:cacheprovider "$@"; }
failures() { [ -s "$1" ] || return 0; echo "-- failures ($(grep -c '^==== FAILED' "$1"), in full in $1):"
  grep '^==== FAILED' "$1"; head -c "${2:-6000}" "$1"; echo; }
# pytest-xdist is in the GPU image; without it the steps run in one process
NPROC=$(nproc); python3 -c "import xdist" 2>/dev/null || NPROC=0
workers() { [ "$NPROC" -gt 0 ] && echo "-n $(( $1 < NPROC ? $1 : NPROC ))"; }
if step gpu; then
  stamp gpu
  # the scenarios on the real GPU only (marked gpu: the fake-GPU ones run in the suite), in
  # parallel: each starts CUDA and JAX in its own processes, which one GPU serves side by side
  limited ${GPU_S:-150} "$OUT/gpu-failures.log" -q -rfEs --timeout 120 --durations 15 $(workers ${GPU_N:-4}) \
    -m gpu -k "${GPU_K:-not nothing}" tests/test_gpu.py > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests exit $?"; tail -25 "$OUT/gpu-tests.log"; failures "$OUT/gpu-failures.log"
fi
if step bench; then
  stamp bench
  timeout 100 python3 bench/gpu_bench.py --profile --json "$OUT/gpu-bench.json" > "$OUT/gpu-bench.log" 2>&1
  echo "bench exit $?"; grep -B2 -A12 "^all-reduce sweep" "$OUT/gpu-bench.log"
fi
if step demo; then
  stamp demo
  timeout ${DEMO_S:-90} python3 demos/train_digits.py --no-progress --device auto --workers 1 --no-baseline \
    --results /tmp/demo-gpu > "$OUT/demo-gpu.log" 2>&1
  echo "demo (device auto, 1 process) exit $?"; tail -6 "$OUT/demo-gpu.log"
fi
if step democpu; then
  stamp democpu
  timeout 90 python3 demos/train_digits.py --no-progress --device cpu --workers 8 \
    --results /tmp/demo-cpu > "$OUT/demo-cpu.log" 2>&1
  echo "demo (device cpu, 1 then 8 processes) exit $?"; tail -8 "$OUT/demo-cpu.log"
fi
if step suite; then
  stamp suite
  # per test --timeout well under the step's limit: a hung test fails with its stacks, not the step
  limited ${SUITE_S:-300} "$OUT/suite-failures.log" -q -rfE --timeout ${SUITE_TEST_S:-150} --durations 25 \
    $(workers ${SUITE_N:-14}) -m "not long" tests > "$OUT/full-suite.log" 2>&1
  echo "suite exit $?"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/full-suite.log" | tail -40
  failures "$OUT/suite-failures.log" 8000
fi
stamp end
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/steps.txt" 2>&1
ls /dev/shm | grep -c synk | sed 's/^/synk names left in \/dev\/shm: /'
