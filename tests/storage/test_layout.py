import uuid

import pytest

from storage.layout import COMMITTED_MARKER, RunLayout


def _touch(fs, path, data=b""):
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # local fs does not auto-create
    fs.pipe_file(path, data)


def test_local_paths_are_exact(tmp_path):
    layout = RunLayout(str(tmp_path), "exp-1.a_b")
    run = f"{tmp_path}/exp-1.a_b"
    assert layout.run_dir == run
    assert layout.stage_path(3, "reward") == f"{run}/steps/3/reward.parquet"
    assert layout.weights_dir("actor", 12) == f"{run}/weights/actor/12"
    assert layout.checkpoint_dir(0) == f"{run}/checkpoints/0"
    assert layout.data_dir == f"{run}/data"
    assert layout.artifacts_dir == f"{run}/artifacts"


def test_memory_uri_paths_drop_protocol_and_trailing_slash():
    layout = RunLayout("memory://bucket/runs/", "r")
    assert layout.run_dir == "/bucket/runs/r"
    assert layout.stage_path(0, "advantages") == "/bucket/runs/r/steps/0/advantages.parquet"
    assert type(layout.fs).__name__ == "MemoryFileSystem"


@pytest.mark.parametrize("name", ["", "a/b", "..", "with space", "ü"])
def test_bad_run_name_names_the_field(tmp_path, name):
    with pytest.raises(ValueError, match=r"run\.name=.* is invalid: use a non-empty name"):
        RunLayout(str(tmp_path), name)


def test_bad_stage_and_step_messages(tmp_path):
    layout = RunLayout(str(tmp_path), "r")
    with pytest.raises(ValueError, match="unknown stage 'rewards'; valid stages: advantages, "):
        layout.stage_path(1, "rewards")
    with pytest.raises(ValueError, match=r"step=-1 is invalid: expected an integer >= 0"):
        layout.stage_path(-1, "reward")
    with pytest.raises(ValueError, match=r"step='2' is invalid"):
        layout.checkpoint_dir("2")
    with pytest.raises(ValueError, match=r"role='../x' is invalid"):
        layout.weights_dir("../x", 1)


def test_committed_stages_ignores_temp_and_unknown_files(tmp_path):
    layout = RunLayout(str(tmp_path), "r")
    assert layout.committed_stages(5) == set()
    for name in ["reward.parquet", "rollout.parquet", "values.parquet.tmp-abc",
                 "notes.parquet", "reference.json"]:
        _touch(layout.fs, f"{layout.run_dir}/steps/5/{name}", b"x")
    assert layout.committed_stages(5) == {"reward", "rollout"}
    assert layout.exists(layout.stage_path(5, "reward"))
    assert not layout.exists(layout.stage_path(5, "values"))


@pytest.mark.parametrize("memory", [False, True])
def test_latest_weights_skips_uncommitted_dirs(tmp_path, memory):
    root = f"memory://{uuid.uuid4().hex}" if memory else str(tmp_path)
    layout = RunLayout(root, "r")
    assert layout.latest_weights("actor") is None
    for step, committed in [(2, True), (10, True), (11, False), (9, True)]:
        directory = layout.weights_dir("actor", step)
        _touch(layout.fs, f"{directory}/model.safetensors", b"w")
        if committed:
            _touch(layout.fs, f"{directory}/{COMMITTED_MARKER}")
    _touch(layout.fs, f"{layout.run_dir}/weights/actor/12.tmp-ff/{COMMITTED_MARKER}")
    assert layout.latest_weights("actor") == (10, layout.weights_dir("actor", 10))
    assert layout.latest_weights("critic") is None


def test_prune_weights_keeps_the_newest_step_zero_and_checkpointed_steps(tmp_path):
    from flows.runtime.recovery import prune_weights

    layout = RunLayout(str(tmp_path), "r")
    for step in range(7):  # weights/actor/0..6, each committed
        _touch(layout.fs, f"{layout.weights_dir('actor', step)}/{COMMITTED_MARKER}")
    _touch(layout.fs, f"{layout.weights_dir('actor', 2)}/model.safetensors", b"x")
    _touch(layout.fs, f"{layout.checkpoint_dir(2)}/driver.json", b"{}")  # a resume would reload step 2
    layout.fs.makedirs(f"{layout.run_dir}/weights/actor/03x", exist_ok=True)  # not a step: left alone

    assert prune_weights(layout, newest=6, keep=None) == []  # keep everything
    # keep 3: steps 4, 5, 6 are the newest; 0 and the checkpointed 2 stay; 1 and 3 go.
    assert prune_weights(layout, newest=6, keep=3) == [1, 3]
    assert layout.step_folders(f"{layout.run_dir}/weights/actor") == [0, 2, 4, 5, 6]
    assert layout.fs.exists(f"{layout.weights_dir('actor', 2)}/model.safetensors")
    assert layout.fs.exists(f"{layout.run_dir}/weights/actor/03x")
    assert layout.latest_weights("actor") == (6, layout.weights_dir("actor", 6))
    # Once checkpoint 2 is gone (keep_checkpoints), its weights go with the next update.
    layout.fs.rm(layout.checkpoint_dir(2), recursive=True)
    assert prune_weights(layout, newest=7, keep=3) == [2, 4]
    assert layout.step_folders(f"{layout.run_dir}/weights/actor") == [0, 5, 6]
