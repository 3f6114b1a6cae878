"""bench/weights_trace.py: the two workers' trace lines become one timeline per hand-over; a wake with no
pull (the first generation's) is not taken for one."""

from __future__ import annotations

from bench.weights_trace import hand_overs, read


def test_the_workers_lines_make_one_timeline_per_hand_over_and_a_lone_wake_is_none(tmp_path):
    rollout = tmp_path / "worker-rollout.log"
    actor = tmp_path / "worker-actor.log"
    rollout.write_text("\n".join([
        "weights-trace 100.000000 pid=1 engine.wake",  # the first generation: no pull
        "weights-trace 100.030000 pid=1 engine.kv_cache_awake",
        "INFO something else",
        "weights-trace 130.000000 pid=1 sync.start version=1",
        "weights-trace 130.001000 pid=1 recv.pull sync=rollout-1-a",
        "weights-trace 130.020000 pid=1 recv.finished number=1",
        "weights-trace 130.100000 pid=1 sync.end version=1",
    ]) + "\n")
    actor.write_text("weights-trace 129.000000 pid=2 send.published version=1\n"
                     "weights-trace 130.002000 pid=2 send.pull_seen number=1\n")
    groups = hand_overs(read([str(rollout), str(actor)]))
    assert len(groups) == 1
    events = [(source, event) for _, source, event, _ in groups[0]]
    assert events == [("worker-rollout", "sync.start"), ("worker-rollout", "recv.pull"),
                      ("worker-actor", "send.pull_seen"), ("worker-rollout", "recv.finished"),
                      ("worker-rollout", "sync.end")]
    assert round(groups[0][-1][0] - groups[0][0][0], 3) == 0.1
