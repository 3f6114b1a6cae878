"""Line up the weights-trace lines of the actor's and the rollout's worker logs (RLHF_WEIGHTS_TRACE=1 in the
workers' environment, e.g. `RLHF_WEIGHTS_TRACE=1 bash bench/gpu-session.sh wk`) into one timeline per
hand-over: every event with its milliseconds since the rollout asked for the weights, and since the event
before it.

    python bench/weights_trace.py .rlhf/logs/<deployment>/worker-*.log
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINE = re.compile(r"weights-trace (?P<time>\d+\.\d+) pid=(?P<pid>\d+) (?P<event>\S+)(?P<fields>.*)")


def read(paths: list[str]) -> list[tuple[float, str, str, str]]:
    """(wall clock, file, event, fields) of every trace line, in time order."""
    events = []
    for path in paths:
        for line in Path(path).read_text(errors="replace").splitlines():
            match = LINE.search(line)
            if match:
                events.append((float(match["time"]), Path(path).stem, match["event"], match["fields"].strip()))
    return sorted(events)


def hand_overs(events: list[tuple[float, str, str, str]]) -> list[list[tuple[float, str, str, str]]]:
    """The events from each `sync.start` (the transport's; else the engine's pull) up to the next `sync.end`
    (else the load's end), with the sender's events in between. An engine's wake outside of them (its first
    generation, from the model's folder) is no hand-over and is left out."""
    groups, current = [], None
    for event in events:
        name = event[2]
        if current is None and name in ("recv.pull", "sync.start"):  # a wake with no pull: no hand-over
            current = []
        if current is not None:
            current.append(event)
            if name == "sync.end" or (name == "recv.finished" and current[0][2] != "sync.start"):
                groups.append(current)
                current = None
    return groups


def main(paths: list[str]) -> None:
    for number, group in enumerate(hand_overs(read(paths)), 1):
        start, before = group[0][0], group[0][0]
        print(f"hand-over {number}: {1e3 * (group[-1][0] - start):.1f} ms")
        for time, source, event, fields in group:
            print(f"  {1e3 * (time - start):8.1f} ms  +{1e3 * (time - before):7.1f}  {source:<16} {event:<22} {fields}")
            before = time


if __name__ == "__main__":
    main(sys.argv[1:])
