#!/usr/bin/env bash
# verl_bench.sh across device calls: verl's start (about 250 s) and three steps (140 + 2 x 120 s) do not fit one
# 10-minute call, so `start` runs it in a process session of its own (setsid), which the device machine keeps
# running after the call returns, and a later call on the same warm machine `wait`s for it.
#   bash bench/verl/background.sh start            # VERL_* / STEPS / T_LIMIT as verl_bench.sh (defaults below)
#   bash bench/verl/background.sh wait SECONDS     # until it ends or SECONDS pass; its results into $OUT/verl/
#   bash bench/verl/background.sh stop             # end it (and Ray's processes)
# Its output: /tmp/verl-run.log (the step lines), /tmp/verl-bench/out/ (verl.log, verl_bench.json, verl_cfg.yaml).
set -uo pipefail
cd "$(dirname "$0")/../.."
RUNLOG=/tmp/verl-run.log; RC=/tmp/verl-run.rc; PIDFILE=/tmp/verl-run.pid; RESULTS=/tmp/verl-bench/out
case "${1:-}" in
  start)
    rm -f "$RC"; rm -rf "$RESULTS"
    # OUT unset: verl_bench.sh writes under /tmp/verl-bench/out, which outlives this call's $OUT
    STEPS=${STEPS:-3} VERL_SAVE_HF=${VERL_SAVE_HF:-1} VERL_SAVE_FREQ=${VERL_SAVE_FREQ:-2} T_LIMIT=${T_LIMIT:-1000} \
      setsid env -u OUT bash -c 'bash bench/verl/verl_bench.sh; echo $? > '"$RC" > "$RUNLOG" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    echo "verl_bench.sh started in its own session (pid $(cat "$PIDFILE")), output $RUNLOG" ;;
  wait)
    limit=${2:-540}; begin=$SECONDS
    while [ ! -f "$RC" ] && [ $((SECONDS - begin)) -lt "$limit" ]; do sleep 5; done
    grep -E "^\[verl_bench|^step |Traceback|Error" "$RUNLOG" | cut -c1-400 | tail -30
    if [ -f "$RC" ]; then
      echo "verl_bench.sh ended: exit $(cat "$RC") after waiting $((SECONDS - begin)) s"
      mkdir -p "${OUT:-bench/results}/verl"
      cp "$RUNLOG" "$RESULTS"/verl_bench.json "$RESULTS"/verl.log "$RESULTS"/verl_cfg.yaml "${OUT:-bench/results}/verl/" 2>/dev/null
    else
      echo "verl_bench.sh still running after $((SECONDS - begin)) s (wait again, or stop)"
    fi ;;
  stop)
    [ -f "$PIDFILE" ] && kill -- -"$(cat "$PIDFILE")" 2>/dev/null
    pkill -f verl.trainer.main_ppo 2>/dev/null
    PYTHONPATH=/tmp/verl-site /tmp/verl-site/bin/ray stop --force > /dev/null 2>&1
    echo "stopped" ;;
  *) echo "usage: $0 start | wait SECONDS | stop" >&2; exit 2 ;;
esac
