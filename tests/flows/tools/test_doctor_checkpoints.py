"""flows.tools.doctor_run.checkpoint_report: what a checkpoint costs, as `rlhf doctor CONFIG` prints it."""

from __future__ import annotations

from flows.config import build_config
from flows.tools.doctor_run import WRITE_PROBE_BYTES, checkpoint_report, storage_write_speed


def _config(tmp_path, **trainer):
    return build_config({"run": {"name": "r", "storage_root": str(tmp_path)}, "trainer": trainer})


def test_the_cost_of_a_checkpoint_is_its_size_over_the_measured_speed_spread_over_the_cadence(tmp_path):
    # 1e9 parameters x 12 bytes (float32 weights + AdamW's two moments) = 12 GB; at 1 GB/s 12 s; every 10 steps 1.2 s
    report = checkpoint_report(_config(tmp_path, checkpoint_every=10), counts={"actor": 10**9}, speed=1e9)
    assert report["bytes"] == 12 * 10**9 and report["write_s"] == 12.0
    assert report["cost"] == ("each 12.00 GB (actor: 12 bytes a parameter, float32 weights and AdamW's two "
                              "moments), about 12.0 s to write at 1000 MB/s (given): 1.20 s a step on average, "
                              "under 5% of steps longer than 24.0 s (trainer.checkpoint_every sets the cadence)")
    assert report["detail"].startswith("every 10 steps and the last, the newest 2 kept") and \
        report["detail"].endswith(report["cost"])


def test_a_critic_doubles_what_is_written_and_no_checkpoints_cost_nothing(tmp_path):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "algorithm": {"adv_estimator": "gae"}, "trainer": {"checkpoint_every": 1}})
    report = checkpoint_report(config, counts={"actor": 10**6, "critic": 10**6}, speed=1e6)
    assert report["bytes"] == 24 * 10**6 and report["write_s"] == 24.0
    assert "(actor + critic: 12 bytes" in report["cost"]
    never = checkpoint_report(_config(tmp_path, checkpoint_every=0), counts={"actor": 10**9}, speed=1e9)
    assert never == {"detail": "never (trainer.checkpoint_every=0): a failed run starts over"}


def test_an_uncounted_model_says_its_size_is_unknown(tmp_path):
    report = checkpoint_report(_config(tmp_path), counts={}, speed=1e9)
    assert report["cost"] == "size unknown (the models' parameters could not be counted: see Placement)"


def test_the_write_speed_is_measured_under_the_storage_root_and_leaves_nothing_there(tmp_path):
    speed, how = storage_write_speed(str(tmp_path / "runs"))
    assert speed is not None and speed > 0 and how == f"a 64 MiB write to {tmp_path / 'runs'} just now"
    assert WRITE_PROBE_BYTES == 64 * 2**20 and list((tmp_path / "runs").iterdir()) == []
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert storage_write_speed(str(blocked / "runs"))[0] is None
