#!/usr/bin/env bash
# The GPU benchmarks of bench/README.md on one 2-GPU host (e.g. nvidia-h200-x2), in phases (`one` and `big` need
# one GPU only: nvidia-h200):
#   bash bench/gpu-session.sh one      one H200, GPU 0, back to back: product GRPO, TRL GRPO, product PPO (0.5B shape,
#                                      STEPS measured steps, default 2), each bounded by what is left of DEADLINE_S
#                                      (default 590 s from the script's start); shared Prefect server; PRODUCT_SET as
#                                      for phase t; ONE_PPO=0 leaves product PPO out, ONE_TRL=0 TRL
#   bash bench/gpu-session.sh lora     one GPU: product GRPO, full fine-tuning then LoRA (LORA_SET, default rank 32,
#                                      alpha 32, all linear layers), per LORA_PRESETS shape (default 0.5b; 0.5b 1.5b
#                                      3b 7b), LORA_MODES (default "full lora"); grpo-1gpu-<size>-<mode>.json;
#                                      PRODUCT_SET as for phase t, bounded by DEADLINE_S as `one`
#   bash bench/gpu-session.sh gen      one H200, GPU 0: bench/rollout.py at the step's shape with vLLM's own settings,
#                                      then each rollout.engine_kwargs variant of GEN_KWARGS (;-separated JSON);
#                                      ROLLOUT_VARIANTS (its --variants) and GEN_REPEATS (default 2) for a shorter call
#   bash bench/gpu-session.sh preset   one GPU: configs/gpu-1x.yaml as a user runs it (`rlhf train` through
#                                      bench/real_model.py on the 0.5B bench model and `rlhf make-data arithmetic`,
#                                      its warm-start included, stopped after the first validated step past PRESET_BUDGET_S of
#                                      training, default 30), then bench/step.py at the preset's knobs (16 + 16
#                                      tokens, micro-batch 64): issue 37's "preset within 20% of step.py";
#                                      PRESET_SET="model.compile=false" overrides both runs' config
#                                      (on a fresh machine keep DEADLINE_S at its 590 default: vLLM's first start
#                                      compiles; at 520 the preset run was stopped in it on 2026-12-07; at 590 the
#                                      preset run took 297 s and step.py, left about 170 s, was stopped before its
#                                      JSON); PRESET_TWIN=0 runs the preset alone, then phase preset-knobs (the twin
#                                      alone) in a second call: both fit one call only just
#   bash bench/gpu-session.sh verl     one H200, GPU 0: verl 0.9.1's GRPO trainer at the `one` phase's knobs
#                                      (bench/verl/README.md; STEPS default 3), for the same lease as `one`
#   bash bench/gpu-session.sh w        one H200, GPU 0: bench/weight_sync.py (storage, then memory) at the 0.5B, then
#                                      the 1.5B shape (weight-sync-0.5b.json, weight-sync-1.5b.json)
#   bash bench/gpu-session.sh ws       one H200, GPU 0: product GRPO (0.5B) with trainer.weight_sync=memory, then storage
#                                      (WS_MODES="storage memory" for the other order)
#   bash bench/gpu-session.sh wk       one H200, GPU 0: product GRPO with the actor and the rollout in workers of their
#                                      own (bench/step.py --workers), trainer.weight_sync=storage then memory, at the
#                                      WK_PRESET shape (default qwen2.5-0.5b; built here unless it is the 0.5B one);
#                                      grpo-workers-<preset>-<mode>.json; WK_MODES="memory storage" for the other order;
#                                      PRODUCT_SET as for phase t; WK_SETS="a=1;b=2 c=3" runs each mode once per
#                                      variant (;-separated, each with PRODUCT_SET), named -<mode>-<last key's end><value> (-default: empty)
#   bash bench/gpu-session.sh ck       one H200, GPU 0: bench/checkpoint.py (a checkpoint written at once against in the
#                                      background) at the 0.5B, then the 1.5B shape (checkpoint-0.5b.json, checkpoint-1.5b.json)
#   bash bench/gpu-session.sh pc       one GPU: bench/pack_convoy.py --device cuda (pack-convoy.json)
#   bash bench/gpu-session.sh big      one H200, GPU 0: product GRPO at the Qwen2.5-1.5B shape, then at the 3B shape
#                                      (grpo-1gpu-1.5b.json, grpo-1gpu-3b.json; models built here in bf16 under
#                                      /tmp/rlhf-bench-models/<preset>), bounded by DEADLINE_S as `one`;
#                                      BIG_PRESETS="3b" runs one of them (e.g. when both do not fit one call);
#                                      PRODUCT_SET="model.gradient_checkpointing=true" if 3B runs out of GPU memory
#   bash bench/gpu-session.sh 1 2      phase 1: product GRPO on GPU 0  |  TRL GRPO on GPU 1   (side by side)
#                                      phase 2: product PPO on GPU 0   |  bench/rollout.py on GPU 1
#   bash bench/gpu-session.sh 3        phase 3: product GRPO, rollout on GPU 0 and training on GPU 1
#   bash bench/gpu-session.sh 4        phase 4: bench/rollout.py with a tensor-parallel engine over both GPUs
#   bash bench/gpu-session.sh 5        phase 5: bench/rollout.py alone on GPU 0
#   bash bench/gpu-session.sh 6        phase 6: as phase 3, with trainer.one_step_ahead
#   bash bench/gpu-session.sh u        bench/update.py on GPU 0: the actor update alone, variants (U_VARIANTS, default
#                                      "defaults compile micro32 compile-micro32 unfused"; also natural and
#                                      natural-unaligned: recompiles over 9 updates of natural lengths, the cut
#                                      lengths aligned to 8 or not; and the code before this change when .baseline/
#                                      holds a copy of it)
#   bash bench/gpu-session.sh table    the issue's whole table in one call (under 10 minutes as measured in
#                                      bench/README.md): GPU 0: product GRPO, then product PPO | GPU 1: TRL GRPO;
#                                      then both GPUs: product GRPO with one-step-ahead, then without; every run
#                                      bounded by what is left of DEADLINE_S (default 590 s from the script's start);
#                                      PRODUCT_SET as for phase t
#   bash bench/gpu-session.sh t        the step table: t1, then t2 (about 13 minutes: more than one 10-minute device
#                                      call; run t1 and t2 as two calls back to back on one lease), with one shared
#                                      Prefect server and 2 measured steps per run (STEPS=3 for more);
#                                      PRODUCT_SET="rollout.engines=2" adds config overrides to every product run
#                                      t1: GPU 0: product GRPO, then product PPO | GPU 1: TRL GRPO
#                                      t2: both GPUs: product GRPO with one-step-ahead, then without
#   bash bench/gpu-session.sh g        bench/rollout.py at the step's shape (256 -> 512 tokens) with 0.85 of GPU 0's
#                                      memory | with 0.4 of GPU 1's (the one-GPU run's setting), side by side
#   bash bench/gpu-session.sh e        bench/rollout.py at the step's shape, one engine on GPU 0 | rollout.engines=2 on
#                                      GPU 1 (two engines sharing the GPU), side by side
#   bash bench/gpu-session.sh te       product GRPO, 1 GPU: rollout.engines=2 on GPU 0 | one engine on GPU 1, side by
#                                      side; then both GPUs, one-step-ahead, rollout.engines=2 on the rollout GPU
#   bash bench/gpu-session.sh s1       t1, and product GRPO with rollout.engines=2 on GPU 1 after TRL
#   bash bench/gpu-session.sh ae       both GPUs, one-step-ahead: rollout.engines=2, then one engine
#   bash bench/gpu-session.sh pe       both GPUs, no one-step-ahead: rollout.engines=2, then one engine
#   bash bench/gpu-session.sh k        kernel: the fused log-prob kernel's CUDA test and bench/logprobs.py on GPU 0
#   bash bench/gpu-session.sh a b      phase a: bench/rollout.py on GPU 0  |  TRL GRPO on GPU 1
#                                      phase b: product GRPO on GPU 0      |  product PPO on GPU 1
#   bash bench/gpu-session.sh c        GPU 0: bench/rollout.py, then product PPO
#                                      GPU 1: product GRPO, then product GRPO with model.fused_logprobs=false
# A fresh machine's first vLLM start compiles (120 s on an H100; 44 s once its cache is there): leave it room in DEADLINE_S.
# Single-GPU runs of one phase share the host (CPUs, PCIe) but not a GPU. Results (JSON; logs packed in
# $OUT/logs-<phases>.tgz with the role workers' logs; log tails printed)
# go to $OUT (default bench/results); the last line prints one table of every step result so far.
set -uo pipefail
# the repository root, $OUT, the staged wheels installed and on the path (without them a call that forgot
# `export PYTHONPATH=/tmp/site` failed at the first import of prefect), the offline environment
source "$(dirname "$0")/device-env.sh"
STARTED=0  # DEADLINE_S counts from the script's start, the wheels' first install (device-env.sh, ~50 s) included
LOGS=$OUT/logs  # every log, and the role workers' logs (.rlhf/logs), packed into $OUT/logs-<phases>.tgz after each run:
mkdir -p "$OUT" "$LOGS"  # a lent GPU machine sends back at most 8 files
PHASES=$(echo "$*" | tr ' ' '-')-$(date +%H%M%S)
pack_logs() {
  mkdir -p "$LOGS/workers" && cp -r .rlhf/logs/. "$LOGS/workers/" 2>/dev/null
  tar czf "$OUT/logs-$PHASES.tgz" -C "$OUT" logs 2>/dev/null  # one archive per invocation (two in one call)
}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}  # engine start and scheduler lines in the logs
PY=${PYTHON:-python3}
MODEL=${MODEL:-/tmp/rlhf-bench-models/qwen2.5-0.5b}

SERVER_STARTING=
shared_prefect_server() {  # one Prefect server for every run of the session (saves its start per run)
  [ -n "${PREFECT_API_URL:-}" ] && [ -z "$SERVER_STARTING" ] && return
  local port=4299
  if [ -z "$SERVER_STARTING" ]; then
    PREFECT_HOME=/tmp/rlhf-bench-prefect PREFECT_LOGGING_LEVEL=WARNING PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL=1 \
      "$PY" -m prefect server start --host 127.0.0.1 \
      --port $port > "$LOGS/prefect-server.log" 2>&1 &
    disown $!  # a later bare `wait` of a phase must not wait for the server
    export PREFECT_API_URL=http://127.0.0.1:$port/api
  fi
  [ "${1:-}" = start ] && { SERVER_STARTING=1; return; }  # started; the next call waits for it
  SERVER_STARTING=
  "$PY" -c "from flows.runtime.launcher import wait_until_healthy; wait_until_healthy('${PREFECT_API_URL%/}', None)"
  echo "== $(date +%T) (+$((SECONDS - STARTED)) s) shared Prefect server at $PREFECT_API_URL"
}
case " $* " in *" table "*|*" t "*|*" t1 "*|*" t2 "*|*" s1 "*|*" ae "*|*" pe "*|*" te "*|*" one "*|*" big "*|*" ws "*|*" wk "*|*" preset "*)
  shared_prefect_server start ;; esac
case " $* " in
  " big "|" pc ") ;;  # big builds its own models (1.5B, 3B), not the 0.5B one; pc needs none
  " wk ") [ "${WK_PRESET:-qwen2.5-0.5b}" = qwen2.5-0.5b ] && \
            "$PY" -c "from bench.common import make_random_model; print(make_random_model('$MODEL'))" ;;
  *) "$PY" -c "from bench.common import make_random_model; print(make_random_model('$MODEL'))" ;;
esac

build_model() {  # build_model PRESET: a random bf16 model of a components/tiny.py preset in /tmp/rlhf-bench-models/PRESET
  local preset=$1 dir=/tmp/rlhf-bench-models/$1
  if [ -n "${DEADLINE_S:-}" ] && [ $((DEADLINE_S - (SECONDS - STARTED))) -lt 150 ]; then
    echo "== model $preset not built: $((SECONDS - STARTED)) s of DEADLINE_S=$DEADLINE_S used"; return 1
  fi
  echo "== $(date +%T) (+$((SECONDS - STARTED)) s) model $preset -> $dir"
  "$PY" -c "from bench.common import make_random_model; print(make_random_model('$dir', '$preset'))" \
    > "$LOGS/model-$preset.log" 2>&1 || { tail -20 "$LOGS/model-$preset.log"; return 1; }
  echo "== $(date +%T) (+$((SECONDS - STARTED)) s) model $preset ready ($(du -sh "$dir" | cut -f1))"
}

run() {  # run NAME GPUS COMMAND...: log to $OUT/NAME.log, keep the JSON in $OUT/NAME.json; MODEL=DIR run ... for
         # another model dir than the 0.5B one (--model-dir "$MODEL" is passed to every command)
  local name=$1 gpus=$2; shift 2
  local limit=${RUN_TIMEOUT:-560}
  if [ -n "${DEADLINE_S:-}" ]; then  # what is left of the call's time, less 10 s to pack the logs
    local left=$((DEADLINE_S - (SECONDS - STARTED) - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then echo "== $name skipped: $((SECONDS - STARTED)) s of DEADLINE_S=$DEADLINE_S used"; return; fi
  fi
  echo "== $(date +%T) (+$((SECONDS - STARTED)) s) $name on GPU $gpus (limit ${limit} s): $*"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$PY" "$@" --model-dir "$MODEL" --out "$OUT/$name.json" \
    > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $(date +%T) (+$((SECONDS - STARTED)) s) $name exit $rc"; grep -E "^\| |^stage seconds|^checkpoint seconds|^== (storage|memory)" "$LOGS/$name.log" | cut -c1-400 || tail -25 "$LOGS/$name.log"
  [ $rc -eq 0 ] || tail -40 "$LOGS/$name.log"
  pack_logs
}

preset_twin() {  # the preset phase's twin: bench/step.py at configs/gpu-1x.yaml's knobs, PRESET_SET as --set overrides
  local step_set=() item
  for item in ${PRESET_SET:-}; do step_set+=(--set "$item"); done
  run grpo-1gpu-preset-knobs 0 bench/step.py --algorithm grpo --gpus 1 --steps "${STEPS:-5}" --prompt-tokens 16 \
    --response-tokens 16 --micro-batch 64 "${step_set[@]}"
}

for phase in "$@"; do
  case $phase in
    ck) export DEADLINE_S=${DEADLINE_S:-590}  # one H200: a checkpoint at once against in the background, 0.5B then 1.5B
       run checkpoint-0.5b 0 bench/checkpoint.py --preset qwen2.5-0.5b
       build_model qwen2.5-1.5b && MODEL=/tmp/rlhf-bench-models/qwen2.5-1.5b run checkpoint-1.5b 0 \
         bench/checkpoint.py --preset qwen2.5-1.5b ;;
    pc) CUDA_VISIBLE_DEVICES=0 "$PY" bench/pack_convoy.py --device cuda --out "$OUT/pack-convoy.json" ;;  # one GPU, seconds
    w) export DEADLINE_S=${DEADLINE_S:-590}  # one H200: weight hand-over, storage then memory, 0.5B then 1.5B shape
       run weight-sync-0.5b 0 bench/weight_sync.py --preset qwen2.5-0.5b
       build_model qwen2.5-1.5b && MODEL=/tmp/rlhf-bench-models/qwen2.5-1.5b run weight-sync-1.5b 0 \
         bench/weight_sync.py --preset qwen2.5-1.5b ;;
    ws) shared_prefect_server  # one H200: the product's GRPO step (0.5B), weights in memory, then through storage
       export DEADLINE_S=${DEADLINE_S:-590}
       steps=${STEPS:-2}
       for mode in ${WS_MODES:-memory storage}; do  # WS_MODES="storage memory": the other order
         run "grpo-1gpu-$mode" 0 bench/step.py --algorithm grpo --gpus 1 --steps "$steps" --set "trainer.weight_sync=$mode"
       done ;;
    wk) shared_prefect_server  # one H200: weights between workers on GPU 0, through storage then streamed
       export DEADLINE_S=${DEADLINE_S:-590}
       preset=${WK_PRESET:-qwen2.5-0.5b}
       model=$MODEL
       if [ "$preset" != qwen2.5-0.5b ]; then build_model "$preset" || continue; model=/tmp/rlhf-bench-models/$preset; fi
       variants=(); while IFS= read -r -d ';' variant; do variants+=("$variant"); done <<< "${WK_SETS:-};"
       for variant in "${variants[@]}"; do
         product_set=(); for item in ${PRODUCT_SET:-} $variant; do product_set+=(--set "$item"); done
         last=${variant##* }; key=${last%%=*}
         tag=; [ ${#variants[@]} -gt 1 ] && tag=-${last:+${key##*.}${last#*=}}; [ "$tag" = - ] && tag=-default
         for mode in ${WK_MODES:-storage memory}; do
           MODEL=$model run "grpo-workers-$preset-$mode$tag" 0 bench/step.py --algorithm grpo --gpus 1 --workers \
             --preset "$preset" --steps "${STEPS:-2}" --set "trainer.weight_sync=$mode" "${product_set[@]}"
         done
       done ;;
    lora) shared_prefect_server  # one GPU: product GRPO with LoRA against full fine-tuning (issue 39), per shape
       export DEADLINE_S=${DEADLINE_S:-590}
       for size in ${LORA_PRESETS:-0.5b}; do
         preset=qwen2.5-$size
         rm -rf /tmp/rlhf-bench-step-*  # what a run killed at the deadline left (bench/step.py deletes its own)
         [ "$size" = 0.5b ] || build_model "$preset" || continue
         for mode in ${LORA_MODES:-full lora}; do
           product_set=(); for item in ${PRODUCT_SET:-}; do product_set+=(--set "$item"); done
           if [ "$mode" = lora ]; then
             for item in ${LORA_SET:-model.lora_rank=32 model.lora_alpha=32}; do product_set+=(--set "$item"); done
           fi
           MODEL=/tmp/rlhf-bench-models/$preset run "grpo-1gpu-$size-$mode" 0 bench/step.py --algorithm grpo --gpus 1 \
             --preset "$preset" --steps "${STEPS:-2}" --set trainer.keep_weights=2 "${product_set[@]}"
         done
       done
       rm -rf /tmp/rlhf-bench-step-* ;;
    one) shared_prefect_server  # one H200: the three 0.5B rows of the table, back to back on GPU 0
       export DEADLINE_S=${DEADLINE_S:-590}
       steps=${STEPS:-2}
       product_set=(); for item in ${PRODUCT_SET:-}; do product_set+=(--set "$item"); done
       run grpo-1gpu 0 bench/step.py --algorithm grpo --gpus 1 --steps "$steps" "${product_set[@]}"
       [ "${ONE_TRL:-1}" = 0 ] || run trl-grpo-1gpu 0 bench/trl_grpo.py --steps "$steps"
       [ "${ONE_PPO:-1}" = 0 ] || run ppo-1gpu 0 bench/step.py --algorithm ppo --gpus 1 --steps "$steps" "${product_set[@]}" ;;
    preset) shared_prefect_server  # one GPU: configs/gpu-1x.yaml as the README runs it, then step.py at its knobs
       export DEADLINE_S=${DEADLINE_S:-590}
       data=/tmp/rlhf-preset-data
       [ -f $data/train.parquet ] || "$PY" -m flows.tools.cli make-data arithmetic $data > "$LOGS/preset-data.log" 2>&1
       "$PY" -m flows.tools.cli doctor configs/gpu-1x.yaml model.path="$MODEL" "data.train_files=[$data/train.parquet]" \
         "data.val_files=[$data/validation.parquet]" 2>&1 | grep -iE "checkpoint|placement|error" | cut -c1-300
       # PRESET_SET (space-separated KEY=VALUE): config overrides for both runs (e.g. model.compile=false)
       preset_set=(); for item in ${PRESET_SET:-}; do preset_set+=("$item"); done
       reserve=$([ "${PRESET_TWIN:-1}" = 0 ] && echo 10 || echo 185)  # kept for step.py's twin run (none: the logs)
       left=$((DEADLINE_S - (SECONDS - STARTED) - reserve))
       [ "$left" -ge 90 ] || { echo "== preset skipped: $((SECONDS - STARTED)) s of DEADLINE_S=$DEADLINE_S used"; continue; }
       echo "== $(date +%T) (+$((SECONDS - STARTED)) s) preset gpu-1x (limit ${left} s)"
       CUDA_VISIBLE_DEVICES=0 timeout "$left" "$PY" bench/real_model.py configs/gpu-1x.yaml model.path="$MODEL" \
         "data.train_files=[$data/train.parquet]" "data.val_files=[$data/validation.parquet]" \
         run.storage_root=/tmp/rlhf-preset-runs "${preset_set[@]}" --budget-s "${PRESET_BUDGET_S:-30}" --max-steps 100 --name preset-gpu-1x \
         --out "$OUT/preset-gpu-1x.json" > "$LOGS/preset-gpu-1x.log" 2>&1
       echo "== $(date +%T) (+$((SECONDS - STARTED)) s) preset gpu-1x exit $?"
       grep -E "^step [0-9]+/|checkpoint|compil|warning" "$LOGS/preset-gpu-1x.log" | cut -c1-250 | tail -14
       grep -ciE "recompil" "$LOGS/preset-gpu-1x.log" | sed 's/^/preset gpu-1x: lines naming a recompile: /'  # TORCH_LOGS=recompiles
       "$PY" - "$OUT/preset-gpu-1x.json" <<'PRESET' || tail -30 "$LOGS/preset-gpu-1x.log"
import json, statistics, sys
rows = json.load(open(sys.argv[1]))["train"]
steps = [r["timing_s/step"] for r in rows[1:]]  # the first step (compilation) left out, as step.py's warm-up
print(f"preset gpu-1x: {len(steps)} steps after the first: step s mean {statistics.mean(steps):.3f} median "
      f"{statistics.median(steps):.3f}; gen {statistics.mean(r['timing_s/gen'] for r in rows[1:]):.3f}, update "
      f"{statistics.mean(r['timing_s/update_actor'] for r in rows[1:]):.3f}; update_rms_ratio min "
      f"{min(r['actor/update_rms_ratio'] or 0 for r in rows[1:]):.2e}; response length "
      f"{statistics.mean(r['response_length/mean'] for r in rows[1:]):.1f}")
PRESET
       rm -rf /tmp/rlhf-preset-runs
       [ "${PRESET_TWIN:-1}" = 0 ] && { pack_logs; continue; }
       preset_twin ;;
    preset-knobs) shared_prefect_server  # one GPU: the preset phase's step.py twin alone (after PRESET_TWIN=0 preset)
       export DEADLINE_S=${DEADLINE_S:-590}
       preset_twin ;;
    verl) # one H200: verl 0.9.1's own GRPO trainer at the `one` phase's knobs (bench/verl/README.md: the wheels copied
       # to /tmp/verl-stage first, VERL_PREP_ONLY=1 once); STEPS (default 3: one warm-up and two measured steps)
       echo "== verl: bench/verl/verl_bench.sh STEPS=${STEPS:-3}"
       # verl's own site only: the product's wheels (/tmp/site, device-env.sh) are not on its path
       CUDA_VISIBLE_DEVICES=0 STEPS=${STEPS:-3} OUT=$OUT env -u PYTHONPATH bash bench/verl/verl_bench.sh 2>&1 | tail -40 ;;
    big) shared_prefect_server  # one H200: product GRPO at the 1.5B, then the 3B shape, on GPU 0
       export DEADLINE_S=${DEADLINE_S:-590}
       steps=${STEPS:-2}
       product_set=(); for item in ${PRODUCT_SET:-}; do product_set+=(--set "$item"); done
       for size in ${BIG_PRESETS:-1.5b 3b}; do
         preset=qwen2.5-$size
         # Disk (64 GiB here): a 3B run's folder holds ~50 GB (fp32 checkpoint with Adam state 36 GB, bf16 weight
         # copies 6 GB each). bench/step.py deletes it at its end; a run killed at the deadline cannot, so remove
         # what such a run left (the runs of this phase go one at a time). keep_weights=2: two weight copies.
         rm -rf /tmp/rlhf-bench-step-*
         build_model "$preset" || continue
         echo "== disk: $(df -h /tmp | tail -1)"
         MODEL=/tmp/rlhf-bench-models/$preset run "grpo-1gpu-$size" 0 bench/step.py --algorithm grpo --gpus 1 \
           --preset "$preset" --steps "$steps" --set trainer.keep_weights=2 "${product_set[@]}"
       done
       rm -rf /tmp/rlhf-bench-step-* ;;
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
    u) update() {  # update NAME ARGS...: bench/update.py on GPU 0
         local name=$1; shift
         echo "== update $name: $*"
         CUDA_VISIBLE_DEVICES=0 timeout 300 "$PY" bench/update.py --model-dir "$MODEL" --out "$OUT/update-$name.json" "$@" \
           > "$LOGS/update-$name.log" 2>&1 || tail -30 "$LOGS/update-$name.log"
         grep -E "^\||^profiled|^update [0-9]|compiled" "$LOGS/update-$name.log"
       }
       if [ -d .baseline ]; then  # the code before the change, run from its own copy
         (cd .baseline && CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$PWD" timeout 300 "$PY" bench/update.py --model-dir "$MODEL" \
            --label before --profile --out "$OUT/update-before.json" > "$LOGS/update-before.log" 2>&1 \
            || tail -30 "$LOGS/update-before.log"; grep -E "^\||^profiled|^update [0-9]" "$LOGS/update-before.log")
       fi
       for variant in ${U_VARIANTS:-defaults compile micro32 compile-micro32 unfused}; do  # U_VARIANTS: a shorter call
         case $variant in
           defaults) update defaults --profile ;;
           compile) update compile --profile --set model.compile=true ;;
           micro32) update micro32 --micro-batch 32 ;;
           compile-micro32) update compile-micro32 --micro-batch 32 --set model.compile=true ;;
           unfused) update unfused --set model.fused_logprobs=false ;;
           natural|natural-unaligned)  # a new batch of natural lengths each update at the gpu-1x preset's knobs: when
             # the compiled blocks compile again, with the cut lengths aligned to 8 (the default), then without
             update "$variant" --natural --steps 9 --prompt-tokens 16 --response-tokens 16 --micro-batch 64 \
               $([ "$variant" = natural ] || echo --align 1) ;;
           *) echo "== update: unknown U_VARIANTS entry $variant" ;;
         esac
       done ;;
    table|t|t1|t2) shared_prefect_server
       # table: t within one call, each run bounded by what is left of DEADLINE_S
       [ "$phase" = table ] && export DEADLINE_S=${DEADLINE_S:-590}
       steps=${STEPS:-2}
       # PRODUCT_SET="rollout.engines=2" (space-separated KEY=VALUE): config overrides for every product run
       product_set=(); for item in ${PRODUCT_SET:-}; do product_set+=(--set "$item"); done
       if [ "$phase" != t2 ]; then
         { run grpo-1gpu 0 bench/step.py --algorithm grpo --gpus 1 --steps "$steps" "${product_set[@]}"
           run ppo-1gpu 0 bench/step.py --algorithm ppo --gpus 1 --steps "$steps" "${product_set[@]}"; } & first=$!
         run trl-grpo-1gpu 1 bench/trl_grpo.py --steps "$steps" & second=$!
         wait $first $second  # not a bare wait: the shared server is a child too
       fi
       if [ "$phase" != t1 ]; then
         run grpo-2gpu-ahead 0,1 bench/step.py --algorithm grpo --gpus 2 --one-step-ahead --steps "$steps" \
           "${product_set[@]}"
         run grpo-2gpu 0,1 bench/step.py --algorithm grpo --gpus 2 --steps "$steps" "${product_set[@]}"
       fi ;;
    s1) # t1 and, on GPU 1 after TRL, product GRPO with rollout.engines=2 (so both engine counts run on one lease)
       shared_prefect_server
       steps=${STEPS:-2}
       { run grpo-1gpu 0 bench/step.py --algorithm grpo --gpus 1 --steps "$steps"
         run ppo-1gpu 0 bench/step.py --algorithm ppo --gpus 1 --steps "$steps"; } & first=$!
       { run trl-grpo-1gpu 1 bench/trl_grpo.py --steps "$steps"
         run grpo-1gpu-engines2 1 bench/step.py --algorithm grpo --gpus 1 --steps "$steps" --set rollout.engines=2; } \
         & second=$!
       wait $first $second ;;
    ae) shared_prefect_server  # both GPUs, one-step-ahead: rollout.engines=2, then 1, on the rollout GPU
       steps=${STEPS:-2}
       run grpo-2gpu-ahead-engines2 0,1 bench/step.py --algorithm grpo --gpus 2 --one-step-ahead --steps "$steps" \
         --set rollout.engines=2
       run grpo-2gpu-ahead 0,1 bench/step.py --algorithm grpo --gpus 2 --one-step-ahead --steps "$steps" ;;
    pe) shared_prefect_server  # both GPUs, no one-step-ahead: rollout.engines=2, then 1, on the rollout GPU
       steps=${STEPS:-2}
       run grpo-2gpu-engines2 0,1 bench/step.py --algorithm grpo --gpus 2 --steps "$steps" --set rollout.engines=2
       run grpo-2gpu 0,1 bench/step.py --algorithm grpo --gpus 2 --steps "$steps" ;;
    gen) # issue 37, item 1: the rollout stage against raw vLLM at the step's shape (64 x 8, 256 -> 512 tokens,
       # 0.4 of the GPU as the one-GPU run), the engine's own settings, then each rollout.engine_kwargs variant of
       # GEN_KWARGS (;-separated JSON objects), one after another on GPU 0, bounded by DEADLINE_S
       export DEADLINE_S=${DEADLINE_S:-590}
       variants=(); [ -n "${ROLLOUT_VARIANTS:-}" ] && variants=(--variants "$ROLLOUT_VARIANTS")  # bench/rollout.py's rows
       run rollout-gen-default 0 bench/rollout.py --prompt-tokens 256 --new-tokens 512 --gpu-memory-utilization 0.4 \
         --repeats "${GEN_REPEATS:-2}" "${variants[@]}"
       gen_kwargs=${GEN_KWARGS:-}
       [ -n "$gen_kwargs" ] || gen_kwargs='{"max_num_batched_tokens": 32768};{"max_num_seqs": 512, "max_num_batched_tokens": 65536};'
       index=0
       while IFS= read -r -d ';' kwargs; do
         [ -n "$kwargs" ] || continue; index=$((index + 1))
         run "rollout-gen-$index" 0 bench/rollout.py --prompt-tokens 256 --new-tokens 512 --gpu-memory-utilization 0.4 \
           --repeats 2 --engine-kwargs "$kwargs"
       done <<< "$gen_kwargs" ;;
    g) # why generation on a rollout-only GPU (0.85 of its memory, no sleep) was slower than on a shared one
       # (0.4): the same bench/rollout.py at the step's shape, both settings side by side
       run rollout-mem085 0 bench/rollout.py --prompt-tokens 256 --new-tokens 512 --gpu-memory-utilization 0.85 &
       run rollout-mem040 1 bench/rollout.py --prompt-tokens 256 --new-tokens 512 --gpu-memory-utilization 0.4 &
       wait ;;
    e) # rollout.engines: does a second engine process on the same GPU raise generation throughput?
       run rollout-engines1 0 bench/rollout.py --prompt-tokens 256 --new-tokens 512 --repeats 2 --engines 1 &
       run rollout-engines2 1 bench/rollout.py --prompt-tokens 256 --new-tokens 512 --repeats 2 --engines 2 &
       wait ;;
    te) steps=${STEPS:-2}
       shared_prefect_server
       run grpo-1gpu-engines2 0 bench/step.py --algorithm grpo --gpus 1 --steps "$steps" --set rollout.engines=2 & first=$!
       run grpo-1gpu 1 bench/step.py --algorithm grpo --gpus 1 --steps "$steps" & second=$!
       wait $first $second
       run grpo-2gpu-ahead-engines2 0,1 bench/step.py --algorithm grpo --gpus 2 --one-step-ahead --steps "$steps" \
         --set rollout.engines=2 ;;
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
pack_logs
rm -rf "$LOGS"
results=$(ls "$OUT"/*gpu.json "$OUT"/*gpu-ahead.json "$OUT"/*gpu-unfused.json "$OUT"/*gpu*-engines2.json \
  "$OUT"/*gpu-*b.json 2>/dev/null)
[ -n "$results" ] && "$PY" bench/step.py --table $results
