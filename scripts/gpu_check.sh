#!/usr/bin/env bash
# Check recscale's CUDA code paths on a machine with an NVIDIA GPU: the CUDA tests
# (tests/test_cuda.py, each against the CPU run of the same thing) and short training runs with
# train.device = cuda, from the CLI. Needs torch with CUDA, numpy, tqdm, pyarrow, ninja, pytest
# and hypothesis installed; recscale runs from this checkout (no install, no network).
#
# Usage, from the repository root:  scripts/gpu_check.sh [LOG_DIR]
# Logs go to LOG_DIR (default: $OUT if set, else ./gpu_check_logs). Exit status: non-zero if any
# step failed; every step runs regardless, so one run reports every failure.
set -uo pipefail
set -x
LOG_DIR=${1:-${OUT:-gpu_check_logs}}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16}   # the native CPU kernels compile on first use
failed=()

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to LOG_DIR/NAME.log, remember a failure
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG_DIR/steps.txt"
  tail -n 40 "$LOG_DIR/$name.log"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

step env 60 bash -c "nvidia-smi; nproc; $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(torch.cuda.get_device_name(0))'"

# The native CPU kernels (three single-file compiles, one core each) build in the background while
# the GPU work runs: the CUDA side never uses them, and the tests' CPU side falls back to the torch
# kernels at once (build timeout 1 s) unless GPU_CHECK_WAIT_KERNELS=1 makes it wait for them.
kernels_log="$LOG_DIR/kernels.log"
(
  export RECSCALE_KERNEL_BUILD_TIMEOUT=${GPU_CHECK_KERNEL_TIMEOUT:-300}
  t0=$SECONDS
  "$PY" -c "from recscale.embedding import native; m = native.load(); print('embedding kernels:', 'built' if m else 'unavailable', native.failure() or '')" &
  "$PY" -c "from recscale.model.native import interaction_kernels as k; print('interaction kernel:', 'built' if k() else 'unavailable')" &
  "$PY" -c "from recscale.checkpoint.native import quantize_kernels as k; print('quantizer kernel:', 'built' if k() else 'unavailable')" &
  wait
  echo "native kernel builds finished after $((SECONDS - t0)) s"
) > "$kernels_log" 2>&1 &
kernels_pid=$!
if [ "${GPU_CHECK_WAIT_KERNELS:-0}" = 1 ]; then
  wait "$kernels_pid"
else
  export RECSCALE_KERNEL_BUILD_TIMEOUT=1
fi

step pytest_cuda 200 "$PY" -m pytest -rA -q -p no:cacheprovider --durations=15 tests/test_cuda.py \
  --junitxml="$LOG_DIR/pytest_cuda.xml"

common=(--config configs/synthetic.toml --set train.device=cuda --set data.num_samples=65536
        --set data.eval_samples=16384 --set train.progress=false)
step train_dot 150 "$PY" -m recscale train "${common[@]}" --set train.eval_every_steps=32 \
  --set checkpoint.dir="$LOG_DIR/ckpt" --set checkpoint.interval_steps=48 --set checkpoint.at_end=false --summary-json "$LOG_DIR/train_dot.json"
# Resume the same job from its last checkpoint (step 48 of 64): it must end with the same summary.
step train_dot_resume 150 "$PY" -m recscale train "${common[@]}" --set train.eval_every_steps=32 \
  --set checkpoint.dir="$LOG_DIR/ckpt" --set checkpoint.interval_steps=48 --set checkpoint.at_end=false --resume latest \
  --summary-json "$LOG_DIR/train_dot_resume.json"
step resume_equal 30 "$PY" -c "
import json, sys
a, b = (json.load(open(sys.argv[i])) for i in (1, 2))
keys = ('eval_auc', 'eval_logloss', 'train_logloss', 'steps', 'samples', 'evals')
diff = {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}
print('resumed from', b.get('resumed_from'), 'differences:', diff)
sys.exit(1 if diff or not b.get('resumed_from') else 0)" "$LOG_DIR/train_dot.json" "$LOG_DIR/train_dot_resume.json"
step train_dcn_bf16 150 "$PY" -m recscale train "${common[@]}" --set model.interaction=dcn \
  --set model.dcn_low_rank=64 --set model.mlp_precision=bf16 --set train.max_steps=32 \
  --summary-json "$LOG_DIR/train_dcn_bf16.json"
# Tables on the SSD tier serve CPU training only: train.device = cuda is refused with the fix in
# one line, and "auto" trains them on the CPU with the same updates as in RAM.
mkdir -p "$LOG_DIR/tier"
small=(--config configs/synthetic.toml --set data.num_samples=16384 --set data.eval_samples=4096
       --set train.max_steps=16 --set train.progress=false)
tier=(--set tiers.ram_budget_mb=24 --set tiers.ssd_dir="$LOG_DIR/tier")
step tiered_cuda_refused 60 bash -c "! $PY -m recscale train ${small[*]} ${tier[*]} --set train.device=cuda > '$LOG_DIR/tiered_cuda.out' 2>&1 \
  && cat '$LOG_DIR/tiered_cuda.out' && grep -q \"'train.device'.*SSD tier\" '$LOG_DIR/tiered_cuda.out' && ! grep -q Traceback '$LOG_DIR/tiered_cuda.out'"
step train_ram_cpu 150 "$PY" -m recscale train "${small[@]}" --set train.device=cpu --summary-json "$LOG_DIR/train_ram_cpu.json"
step train_tiered_auto 150 "$PY" -m recscale train "${small[@]}" "${tier[@]}" --summary-json "$LOG_DIR/train_tiered_auto.json"
step tiered_equal 30 "$PY" -c "
import json, sys
a, b = (json.load(open(sys.argv[i])) for i in (1, 2))
keys = ('eval_auc', 'eval_logloss', 'train_logloss', 'steps', 'samples')
diff = {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}
print('device', b.get('device'), 'tier files:', sys.argv[3], 'differences from the run in RAM:', diff)
sys.exit(1 if diff or not str(b.get('device')).startswith('cpu') else 0)" \
  "$LOG_DIR/train_ram_cpu.json" "$LOG_DIR/train_tiered_auto.json" "$(ls "$LOG_DIR/tier" | wc -l)"
rm -rf "$LOG_DIR/tier"
find "$LOG_DIR/ckpt" -maxdepth 3 -printf "%s %p\\n" > "$LOG_DIR/ckpt_files.txt" 2>&1
rm -rf "$LOG_DIR/ckpt"  # model-sized files: their listing is kept

# Report the kernel builds (waiting a bounded time for them; killed if still compiling).
for _ in $(seq 1 "${GPU_CHECK_KERNEL_WAIT_S:-45}"); do kill -0 "$kernels_pid" 2>/dev/null || break; sleep 1; done
if kill -0 "$kernels_pid" 2>/dev/null; then
  echo "native kernel builds still running at the end: stopped" >> "$kernels_log"
  pkill -TERM -P "$kernels_pid" 2>/dev/null; kill "$kernels_pid" 2>/dev/null
fi
echo "== kernels:"; cat "$kernels_log" | tee -a "$LOG_DIR/steps.txt"

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" | tee -a "$LOG_DIR/steps.txt"
  exit 1
fi
echo "all steps passed" | tee -a "$LOG_DIR/steps.txt"
