#!/bin/bash
# The GPU validation of docs/gpu-validation.rst, as one command for the device machine:
#   bash tests/gpu_validate.sh [STEPS]     (STEPS: any of env,gpu,bench,demo,democpu,suite; default env,gpu,bench,demo,democpu)
# Installs the carried wheels (.whl) into /tmp/site, then writes every log under $OUT (or ./gpu-out).
# Each step has its own time limit, so one that hangs cannot eat the others' time.
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
if step gpu; then
  stamp gpu
  timeout ${GPU_S:-240} python3 -m pytest -q -rs -p no:cacheprovider --timeout 150 --durations 15 -k "${GPU_K:-not nothing}" \
    tests/test_gpu.py tests/test_nccl_logic.py > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests exit $?"; tail -25 "$OUT/gpu-tests.log"
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
  timeout ${SUITE_S:-240} python3 -m pytest -q -rs -p no:cacheprovider -n ${SUITE_N:-6} --timeout 200 tests \
    > "$OUT/full-suite.log" 2>&1
  echo "suite exit $?"; tail -40 "$OUT/full-suite.log"
fi
stamp end
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/steps.txt" 2>&1
ls /dev/shm | grep -c synk | sed 's/^/synk names left in \/dev\/shm: /'
