#!/usr/bin/env bash
# verl 0.9.1's own GRPO trainer (python3 -m verl.trainer.main_ppo: V1 sync trainer, FSDP actor, vLLM 0.24.0 rollout
# in hybrid engine, one GPU) at the knobs of rlhf-flow's bench/step.py. Runs on the lent H200 from the root of the copy that travels
# root, after the copy calls have put .device-verl/.device-stage/part* into /tmp/verl-stage/ (bench/verl/README.md).
#   bash bench/verl/verl_bench.sh                      # 4 steps (1 warm-up + 3 measured), verl's engine defaults
#   VERL_PREP_ONLY=1 bash bench/verl/verl_bench.sh     # install, model, data, imports, config check (about 2 min)
#   VERL_MATCH_ENGINE=1 bash bench/verl/verl_bench.sh  # + vLLM's H200 defaults that the product's engine gets
# env: STEPS=4 GPU_UTIL=0.4 T_LIMIT=540 (seconds for the whole call) VERL_SAVE_HF=1 (save + compare the final actor
# weights: a checkpoint inside the saving step's timing_s/step, which the summary takes out again) VERL_SAVE_FREQ
# (default STEPS: the last step only) VERL_EXTRA="k=v ..." (more hydra overrides)
set -uo pipefail
ROOT=$PWD; START=$SECONDS
LIMIT=${T_LIMIT:-540}; STEPS=${STEPS:-4}
STAGE=/tmp/verl-stage; SITE=/tmp/verl-site; WORK=${VERL_WORK:-/tmp/verl-bench}; PY=${PYTHON:-python3}
CFG_ONLY=${VERL_CFG_ONLY:-0}
OUTD=${OUT:-$WORK/out}; mkdir -p "$OUTD" "$WORK"
log() { echo "[verl_bench +$((SECONDS - START)) s] $*"; }

if [ "$CFG_ONLY" != 1 ] && [ ! -f $SITE/.done ]; then
  (cd $STAGE && { [ -d wheels ] || cat part* | tar xf -; }) || { log "no wheels under $STAGE (copy calls first)"; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --target $SITE $STAGE/wheels/*.whl 2>&1 \
    | grep -v "as the 'root' user" | tail -3
  touch $SITE/.done; log "installed $(ls $STAGE/wheels | wc -l) wheels into $SITE"
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=$WORK/hf \
  RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0 RAY_DISABLE_DOCKER_CPU_WARNING=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  WANDB_MODE=disabled VERL_LOGGING_LEVEL=INFO
$PY - <<'EOF' 2>&1 | tail -3
import importlib.metadata as m
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print("versions:", {p: version(p) for p in ("verl", "vllm", "ray", "transformers", "tokenizers", "torch",
                                            "tensordict", "transferqueue", "hydra-core", "omegaconf")})
EOF

if [ "$CFG_ONLY" != 1 ]; then
  $PY bench/verl/verl_bench_setup.py model $WORK/model || exit 3
  $PY bench/verl/verl_bench_setup.py data $WORK/model $WORK/data/train.parquet --prompts $((64 * STEPS)) --tokens 256 || exit 3
  log "model and data ready"
fi

# Ray's object store in /dev/shm: 4 GiB or 60% of what is free there; below 512 MiB, 2 GiB in /tmp (slow storage).
SHM=$(( $(df -k --output=avail /dev/shm 2>/dev/null | tail -1 || echo 0) * 1024 ))
OBJ=$(( SHM * 6 / 10 )); [ $OBJ -gt $((4 << 30)) ] && OBJ=$((4 << 30))
if [ $OBJ -lt $((512 << 20)) ]; then OBJ=$((2 << 30)); export RAY_OBJECT_STORE_ALLOW_SLOW_STORAGE=1; fi
log "/dev/shm free $((SHM >> 20)) MiB; ray object_store_memory $((OBJ >> 20)) MiB"

ENGINE=()
[ "${VERL_MATCH_ENGINE:-0}" = 1 ] && ENGINE=(actor_rollout_ref.rollout.max_num_seqs=1024
                                           actor_rollout_ref.rollout.max_num_batched_tokens=16384)
SAVE=(trainer.save_freq=-1)
# VERL_SAVE_FREQ=2 with STEPS=3: a save after step 2 as well, so a call cut short in step 3 still has weights to compare
[ "${VERL_SAVE_HF:-0}" = 1 ] && SAVE=(trainer.save_freq=${VERL_SAVE_FREQ:-$STEPS} "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]")
ARGS=(
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=False
  data.train_files=$WORK/data/train.parquet
  data.val_files=$WORK/data/train.parquet
  data.train_batch_size=64
  data.max_prompt_length=256
  data.max_response_length=512
  data.filter_overlong_prompts=False
  data.truncation=error
  actor_rollout_ref.model.path=$WORK/model
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  actor_rollout_ref.model.use_remove_padding=False
  actor_rollout_ref.model.enable_gradient_checkpointing=False
  actor_rollout_ref.actor.strategy=fsdp
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.optim.weight_decay=0.0
  actor_rollout_ref.actor.ppo_mini_batch_size=64
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
  actor_rollout_ref.actor.ppo_epochs=1
  actor_rollout_ref.actor.use_kl_loss=False
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.fsdp_config.param_offload=False
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.mode=async
  actor_rollout_ref.rollout.n=8
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=${GPU_UTIL:-0.4}
  actor_rollout_ref.rollout.ignore_eos=True
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.max_model_len=768
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  "${ENGINE[@]}"
  reward.custom_reward_function.path=$ROOT/bench/verl/verl_reward.py
  reward.custom_reward_function.name=compute_score
  trainer.logger=[console]
  trainer.project_name=verl_bench
  trainer.experiment_name=grpo_q05
  trainer.val_before_train=False
  trainer.test_freq=-1
  "${SAVE[@]}"
  trainer.resume_mode=disable
  trainer.default_local_dir=$WORK/ckpt
  trainer.n_gpus_per_node=1
  trainer.nnodes=1
  trainer.total_training_steps=$STEPS
  ray_kwargs.ray_init.num_cpus=16
  +ray_kwargs.ray_init.include_dashboard=False
  +ray_kwargs.ray_init.object_store_memory=$OBJ
)
# shellcheck disable=SC2206
ARGS+=(${VERL_EXTRA:-})
if [ "${VERL_PREP_ONLY:-0}" = 1 ]; then  # install, model, data, imports and the config check; no training
  $PY - <<'PYCHK' 2>&1 | grep -v "^WARNING" | tail -5
import time
t = time.time()
import torch, vllm, ray, verl, transfer_queue, tensordict, transformers  # noqa: E401
from verl.workers.rollout.vllm_rollout import vllm_async_server  # noqa: F401
from verl.trainer.ppo.v1 import trainer_sync  # noqa: F401
from verl.workers import engine_workers  # noqa: F401
print(f"imports ok in {time.time() - t:.1f} s: torch {torch.__version__} cuda {torch.cuda.is_available()}, vllm "
      f"{vllm.__version__}, transformers {transformers.__version__} from {transformers.__file__}")
PYCHK
  CFG_ONLY=1
fi
if [ "$CFG_ONLY" = 1 ]; then  # compose and check the config only (no Ray, no GPU)
  $PY -m verl.trainer.main_ppo --cfg job "${ARGS[@]}" > "$OUTD/verl_cfg.yaml" 2>&1; RC=$?
  [ $RC -ne 0 ] && tail -30 "$OUTD/verl_cfg.yaml"
  $PY bench/verl/verl_bench_setup.py validate "${ARGS[@]}" || RC=1
  log "config only: exit $RC ($OUTD/verl_cfg.yaml)"; exit $RC
fi
LEFT=$(( LIMIT - (SECONDS - START) - 25 ))
log "main_ppo: $STEPS steps, time limit ${LEFT} s"
timeout -k 10 $LEFT $PY -m verl.trainer.main_ppo "${ARGS[@]}" < /dev/null > "$OUTD/verl.log" 2>&1 &
PID=$!
# the step lines as they come (the full log, with Ray's and vLLM's, is $OUTD/verl.log)
tail -n +1 -f "$OUTD/verl.log" --pid=$PID 2>/dev/null | awk '
  BEGIN { split("timing_s/step timing_s/gen timing_s/old_log_prob timing_s/update_actor timing_s/update_weights " \
                "actor/grad_norm actor/pg_loss critic/score/mean response_length/mean", k, " "); for (i in k) want[k[i]] = 1 }
  /step:[0-9]+ - / { n = split($0, p, " - "); out = p[1]; sub(/.*step:/, "step ", out)
                     for (i = 2; i <= n; i++) { key = substr(p[i], 1, index(p[i], ":") - 1); if (key in want) out = out "  " p[i] }
                     print out; fflush(); next }
  /Traceback|Error:|OutOfMemory|Started a local Ray|Training Progress: +0%/ { print substr($0, 1, 300); fflush() }' &
wait $PID; RC=$?
sleep 1
log "main_ppo exit $RC (124: time limit)"
if [ "$(stat -c %s "$OUTD/verl.log")" -gt $((15 << 20)) ]; then  # files over 16 MiB do not come back
  { head -c $((2 << 20)) "$OUTD/verl.log"; echo; echo "[... cut ...]"; tail -c $((12 << 20)) "$OUTD/verl.log"; } > "$OUTD/verl.cut.log"
  mv "$OUTD/verl.cut.log" "$OUTD/verl.log"
fi
[ $RC -ne 0 ] && { grep -nE "Traceback|Error" "$OUTD/verl.log" | head -20; tail -40 "$OUTD/verl.log" | cut -c1-400; }
$PY bench/verl/verl_bench_setup.py summary "$OUTD/verl.log" "$OUTD/verl_bench.json" --warmup 1
if [ "${VERL_SAVE_HF:-0}" = 1 ]; then
  HF=$(ls -d $WORK/ckpt/global_step_*/actor/huggingface 2>/dev/null | sort -t_ -k3 -n | tail -1)  # the newest save
  log "comparing the initial model with $HF"
  [ -n "$HF" ] && $PY bench/verl/verl_bench_setup.py compare $WORK/model "$HF" --json "$OUTD/verl_bench.json" \
    || log "no saved actor weights"
fi
# leave no Ray or vLLM process holding the GPU for the next call
{ $SITE/bin/ray stop --force || $PY -m ray.scripts.scripts stop --force; } > /dev/null 2>&1
nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | sed 's/^/GPU memory used after: /'
log "done"
exit $RC
