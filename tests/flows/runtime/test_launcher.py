"""flows.runtime.launcher: print_worker_summary (one line per worker heartbeat, a dead (replaced) worker marked) and
the command lines of WorkerPool's workers."""

from __future__ import annotations

import json

from flows.runtime.launcher import WorkerPool, print_worker_summary


def test_a_worker_whose_heartbeat_stopped_is_marked_gone(tmp_path, capsys):
    def write(pid, beat, finished):
        (tmp_path / f"reward-host-{pid}.json").write_text(json.dumps(
            {"role": "reward", "pid": pid, "devices": "", "started": pid, "beat": beat, "running": [],
             "finished": finished, "load_counts": {"reward": 1}}))

    write(11, beat=1000.0, finished=[["reward", 0]])  # killed at 1000
    write(12, beat=1059.5, finished=[["reward", 1]])  # its replacement, beating
    print_worker_summary(str(tmp_path), now=1060.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "worker reward    pid 11 devices cpu stages run 1 model loads {'reward': 1} (gone: last heartbeat 60 s ago)",
        "worker reward    pid 12 devices cpu stages run 1 model loads {'reward': 1}",
    ]


def test_a_worker_serving_another_roles_stages_is_started_with_also_serve(tmp_path, monkeypatch):
    """A LoRA run's reference has no worker: the actor's serves its stages (flows.training.plan.worker_also_serves)."""
    started = {}
    monkeypatch.setattr("flows.runtime.launcher.subprocess.Popen",
                        lambda command, **kwargs: started.setdefault(command[command.index("--role") + 1], command))
    pool = WorkerPool({"rollout": [0], "actor": [1], "reward": "cpu"}, {}, tmp_path, also_serve={"actor": ["reference"]})
    for role in pool.assignments:
        pool._start(role)
    assert started["actor"][started["actor"].index("worker"):] == [
        "worker", "--role", "actor", "--devices", "1", "--also-serve", "reference"]
    assert "--also-serve" not in started["rollout"] and "--also-serve" not in started["reward"]
