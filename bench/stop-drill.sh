#!/usr/bin/env bash
# Recovery drill on a GPU machine: `rlhf run` (every role a worker; the rollout a vLLM engine on GPU 0) of the
# quickstart task, SIGTERM to the driver in the middle of step 3, then `rlhf resume`. Prints how long the stop
# took, the driver's last lines, what processes and GPU memory were left, and the resumed run's end.
#   bash bench/stop-drill.sh            (needs the quickstart's tiny model and data: made here if missing)
set -uo pipefail
cd "$(dirname "$0")/.."
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 MLFLOW_ENABLE_TELEMETRY=false
cli() { python -m flows.tools.cli "$@"; }
[ -f .rlhf/models/tiny-qwen2/config.json ] || cli make-tiny-model .rlhf/models/tiny-qwen2 > /dev/null
[ -f .rlhf/data/arithmetic/train.parquet ] || cli make-data arithmetic .rlhf/data/arithmetic > /dev/null
name=stop-drill-$(date +%H%M%S)
settings=(run.name=$name trainer.total_steps=6 warm_start.steps=100 rollout.engine=vllm ${DRILL_SET:-})
python -m flows.tools.cli run configs/quickstart.yaml "${settings[@]}" > "/tmp/$name-1.log" 2>&1 &  # $! is the driver
driver=$!
while [ ! -f ".rlhf/runs/$name/steps/2/reward.parquet" ] && kill -0 $driver 2>/dev/null; do sleep 0.2; done
echo "== driver $driver children before the stop:"; ps -o pid=,args= --ppid $driver | cut -c1-110
start=$(date +%s.%N); kill -TERM $driver; wait $driver; code=$?; end=$(date +%s.%N)
echo "== SIGTERM to exit: $(python3 -c "print(f'{$end - $start:.1f}')") s, exit code $code; last lines:"
tail -3 "/tmp/$name-1.log" | cut -c1-200
sleep 2
echo "== left after the stop: $(pgrep -f 'flows.tools.cli (worker|run)|prefect server start' | wc -l) driver/worker/server processes"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed 's/^/   GPU process: /'
resumed=$(date +%s)
cli resume "$name" > "/tmp/$name-2.log" 2>&1; echo "== resume exit code $? after $(( $(date +%s) - resumed )) s; its lines:"
grep -E "resuming|step [0-9]+/6|validation reward|Crashed|error" "/tmp/$name-2.log" | cut -c1-200 | tail -12
