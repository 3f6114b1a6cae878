#!/usr/bin/env bash
# The GPU benchmarks of bench/README.md on one 2-GPU host (e.g. nvidia-h200-x2), in phases:
#   bash bench/gpu-session.sh 1 2      phase 1: product GRPO on GPU 0  |  TRL GRPO on GPU 1   (side by side)
#                                      phase 2: product PPO on GPU 0   |  bench/rollout.py on GPU 1
#   bash bench/gpu-session.sh 3        phase 3: product GRPO, rollout on GPU 0 and training on GPU 1
#   bash bench/gpu-session.sh 4        phase 4: bench/rollout.py with a tensor-parallel engine over both GPUs
#   bash bench/gpu-session.sh 5        phase 5: bench/rollout.py alone on GPU 0
#   bash bench/gpu-session.sh 6        phase 6: as phase 3, with trainer.one_step_ahead
#   bash bench/gpu-session.sh k        kernel: the fused log-prob kernel's CUDA test and bench/logprobs.py on GPU 0
#   bash bench/gpu-session.sh a b      phase a: bench/rollout.py on GPU 0  |  TRL GRPO on GPU 1
#                                      phase b: product GRPO on GPU 0      |  product PPO on GPU 1
#   bash bench/gpu-session.sh c        GPU 0: bench/rollout.py, then product PPO
#                                      GPU 1: product GRPO, then product GRPO with model.fused_logprobs=false
# Single-GPU runs of one phase share the host (CPUs, PCIe) but not a GPU. Results (JSON + log tails)
# go to $OUT (default bench/results); the last line prints one table of every step result so far.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 MLFLOW_ENABLE_TELEMETRY=false
PY=${PYTHON:-python3}
MODEL=${MODEL:-/tmp/rlhf-bench-models/qwen2.5-0.5b}
"$PY" -c "from bench.common import make_random_model; print(make_random_model('$MODEL'))"

run() {  # run NAME GPUS COMMAND...: log to $OUT/NAME.log, keep the JSON in $OUT/NAME.json
  local name=$1 gpus=$2; shift 2
  echo "== $name on GPU $gpus: $*"
  CUDA_VISIBLE_DEVICES=$gpus timeout "${RUN_TIMEOUT:-560}" "$PY" "$@" --model-dir "$MODEL" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name exit $rc"; grep -E "^\| |^RESULT" "$OUT/$name.log" | cut -c1-400 || tail -25 "$OUT/$name.log"
  [ $rc -eq 0 ] || tail -40 "$OUT/$name.log"
}

for phase in "$@"; do
  case $phase in
    1) run grpo-1gpu 0 bench/step.py --algorithm grpo --gpus 1 &
       run trl-grpo-1gpu 1 bench/trl_grpo.py &
       wait ;;
    2) run ppo-1gpu 0 bench/step.py --algorithm ppo --gpus 1 &
       run rollout-1gpu 1 bench/rollout.py &
       wait ;;
    3) run grpo-2gpu 0,1 bench/step.py --algorithm grpo --gpus 2 ;;
    4) run rollout-tp2 0,1 bench/rollout.py --tp 2 ;;
    5) run rollout-1gpu 0 bench/rollout.py ;;
    6) run grpo-2gpu-ahead 0,1 bench/step.py --algorithm grpo --gpus 2 --one-step-ahead ;;
    k) CUDA_VISIBLE_DEVICES=0 "$PY" -m pytest -q -p no:cacheprovider tests/components/test_fused.py 2>&1 | tail -3
       CUDA_VISIBLE_DEVICES=0 "$PY" bench/logprobs.py --out "$OUT/logprobs.json" 2>&1 | grep -E "^\||^logits|Error" ;;
    a) run rollout-1gpu 0 bench/rollout.py &
       run trl-grpo-1gpu 1 bench/trl_grpo.py &
       wait ;;
    c) { run rollout-1gpu 0 bench/rollout.py; run ppo-1gpu 0 bench/step.py --algorithm ppo --gpus 1; } &
       { run grpo-1gpu 1 bench/step.py --algorithm grpo --gpus 1
         run grpo-1gpu-unfused 1 bench/step.py --algorithm grpo --gpus 1 --set model.fused_logprobs=false; } &
       wait ;;
    b) run grpo-1gpu 0 bench/step.py --algorithm grpo --gpus 1 &
       run ppo-1gpu 1 bench/step.py --algorithm ppo --gpus 1 &
       wait ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
results=$(ls "$OUT"/*gpu.json "$OUT"/*gpu-ahead.json "$OUT"/*gpu-unfused.json 2>/dev/null)
[ -n "$results" ] && "$PY" bench/step.py --table $results
