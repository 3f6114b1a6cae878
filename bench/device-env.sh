# Sourced by the bench/*-session.sh scripts on the lent GPU machine: the repository root as the current folder, $OUT
# made, the staged wheels (/tmp/stage, bench/README.md) installed into /tmp/site once, and the environment the runs
# share (offline, no telemetry).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if [ -d /tmp/stage ] && [ ! -d /tmp/site ]; then  # not on a machine where nothing was staged
  (cd /tmp/stage && { [ -d wheels ] || cat part* | tar xf -; }) &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/wheels/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false \
  DO_NOT_TRACK=1 MLFLOW_ENABLE_TELEMETRY=false TOKENIZERS_PARALLELISM=false
