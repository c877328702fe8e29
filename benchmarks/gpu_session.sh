#!/usr/bin/env bash
# Everything fxpipe measures on one GPU, in one call of the device tool (a session lent a GPU has
# 15 minutes of device time in all, a call at most 10): the CUDA tests, then the GPU rows of the
# benchmarks, each step bounded so the whole script ends within 9 minutes. Run from the repo root:
#
#     bash benchmarks/gpu_session.sh          # results under $OUT (or /tmp/gpu_session)
#
# The device machine's python3 holds a CUDA torch and transformers but not OR-Tools: carry its
# wheels (the device tool's README: `pip download --no-deps --only-binary=:all: --python-version
# 3.12 ... -d .whl ortools immutabledict`, `.whl` in .git/info/exclude and in `carry`); this script
# installs whatever lies in .whl first. At most 8 files come back: the log and seven results.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
LOG="$OUT/gpu_session.log"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: run it bounded, its output into the one log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name: rc=$? $(date +%T)" | tee -a "$LOG"
}

{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } >>"$LOG" 2>&1
# the CUDA tests (they skip on a machine without CUDA)
step cuda-tests 100 python3 -m pytest -q -x -p no:cacheprovider \
  tests/codegen/test_devices.py tests/codegen/test_operators.py tests/test_import_contract.py
# one stage eager vs compiled, fp32 and bf16, and how much of it is matrix products
step compile-probe 80 python3 benchmarks/runtime/compile_probe.py --device cuda --model gpt_wide \
  --gemm-share --out "$OUT"
# one stage's F, I (B) and W: eager, compiled with one backward graph, compiled in halves
step split-halves 60 python3 benchmarks/runtime/bench_split_halves.py --device cuda \
  --model gpt_medium --out "$OUT/split_halves_cuda.json"
# the compiled-stages table's one-rank rows: fxpipe eager / compiled / peer per schedule
step compiled 200 python3 benchmarks/runtime/bench_compiled.py --device cuda --model gpt_medium \
  --schedules 1f1b,zbv --steps 10 --out "$OUT"
# the planner's CUDA predictions against one GPU (step time, peak memory)
step one-gpu 90 python3 benchmarks/prediction/one_gpu.py --steps 10 --out "$OUT"
ls -l "$OUT" >>"$LOG"
