#!/usr/bin/env bash
# Stage the wheels of verl 0.9.1's run (bench/verl/README.md) for the GPU machine, which reaches no index:
# .device-verl/.device-stage/part00.. (git-excluded), 55 MiB each (a device call carries the tree too, 64 MiB in all), copied there one call each before the bench.
#   bash bench/verl/stage.sh          # from the repository root; SHARED=../shared by default
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
SHARED=${SHARED:-$(cd .. && pwd)/shared}
grep -qx "/.device-verl/" .git/info/exclude 2>/dev/null || echo "/.device-verl/" >> .git/info/exclude
mkdir -p .device-verl && cd .device-verl
# the exact list the recipe ran with; antlr4-python3-runtime has only an sdist on PyPI: built into a wheel here
grep -v '^antlr4' ../bench/verl/verl-gpu-wheels.txt > pins.txt
python3 "$SHARED/device/stage-wheels.py" -r pins.txt
ls .device-stage/wheels | grep -q '^antlr4' || \
  python3 -m pip wheel -q --no-deps -w .device-stage/wheels antlr4-python3-runtime==4.9.3
cd .device-stage && rm -f part* && tar cf - wheels | split -b 55m -d - part
echo "$(ls wheels | wc -l) wheels, $(du -sh wheels | cut -f1); parts: $(ls part* | tr '\n' ' ')"
