"""flows.runtime.batches on a run folder in tmp_path: a batch written reads back the same, checked against
the rollout's samples; it is committed only once whole (a write that fails midway leaves nothing under its
final name); it lies where RunLayout.stage_path says; recovery finds it through the same seam."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.config import build_config
from flows.runtime.batches import Batches, StorageBatches, batches_for
from storage import RunLayout, StageFileError

UIDS = ["s2-0", "s2-1", "s2-2"]


@pytest.fixture
def batches(tmp_path):
    return StorageBatches(RunLayout(str(tmp_path), "r"))


def test_a_batch_written_reads_back_the_same_checked_against_the_rollouts_samples(tmp_path, batches):
    path = batches.write(2, "reward", {"uid": UIDS, "score": [0.5, -1.0, 0.25]})
    assert path == str(tmp_path / "r" / "steps" / "2" / "reward.parquet") == batches.path(2, "reward")
    table = batches.read(2, "reward")
    assert table.column_names == ["uid", "score"]
    assert table.column("uid").to_pylist() == UIDS
    assert table.column("score").to_pylist() == [0.5, -1.0, 0.25]  # exact in float32
    assert table.schema.field("score").type == pa.float32()
    assert batches.read(2, "reward", expected_uids=UIDS).equals(table)
    with pytest.raises(StageFileError, match="1 of 3 uids differ from the expected order; first at row 2"):
        batches.read(2, "reward", expected_uids=["s2-0", "s2-1", "s2-9"])
    with pytest.raises(StageFileError, match="has 3 rows, expected 2"):
        batches.read(2, "reward", expected_uids=["s2-0", "s2-1"])
    with pytest.raises(StageFileError, match="stage file not found"):
        batches.read(3, "reward")


def test_a_table_round_trips_with_its_ragged_columns(batches):
    columns = {"uid": ["a", "b"], "values": [[0.5, 1.5, -2.0], [0.25]]}
    batches.write(0, "values", pa.table({"uid": columns["uid"],
                                         "values": pa.array(columns["values"], pa.list_(pa.float32()))}))
    assert batches.read(0, "values").to_pydict() == columns


def test_a_batch_is_committed_once_written_and_only_at_its_step(batches):
    assert not batches.committed(1, "reward") and batches.committed_stages(1) == set()
    assert not batches.readable(1, "reward")
    batches.write(1, "reward", {"uid": UIDS, "score": [1.0, 0.0, 1.0]})
    assert batches.committed(1, "reward") and batches.committed_stages(1) == {"reward"}
    assert batches.readable(1, "reward") and batches.readable(1, "reward", expected_rows=3)
    assert not batches.readable(1, "reward", expected_rows=4)
    assert not batches.committed(2, "reward") and not batches.committed(1, "advantages")


def test_a_write_that_fails_midway_leaves_nothing_committed(tmp_path, batches, monkeypatch):
    def fails_midway(table, handle, *args, **kwargs):
        handle.write(b"PAR1 half a file")
        raise OSError("disk full")
    monkeypatch.setattr(pq, "write_table", fails_midway)
    with pytest.raises(OSError, match="disk full"):
        batches.write(1, "reward", {"uid": UIDS, "score": [1.0, 0.0, 1.0]})
    assert not batches.committed(1, "reward") and batches.committed_stages(1) == set()
    assert not (tmp_path / "r" / "steps" / "1" / "reward.parquet").exists()
    assert list((tmp_path / "r" / "steps" / "1").iterdir()) == []  # nor its temporary sibling


def test_a_batch_that_does_not_match_its_schema_is_refused_before_anything_is_written(batches):
    with pytest.raises(StageFileError):
        batches.write(1, "reward", {"uid": UIDS, "score": [1.0, 0.0]})
    assert not batches.committed(1, "reward")


def test_a_bad_batch_is_discarded_or_kept_aside(tmp_path, batches):
    for step in (1, 2):
        batches.write(step, "reward", {"uid": UIDS, "score": [1.0, 0.0, 1.0]})
        (tmp_path / "r" / "steps" / str(step) / "reward.parquet").write_bytes(b"PAR1 truncated")
        assert batches.committed(step, "reward") and not batches.readable(step, "reward")
    batches.discard(1, "reward")
    batches.discard(2, "reward", keep_aside=True)
    assert not batches.committed(1, "reward") and not batches.committed(2, "reward")
    assert sorted(path.name for path in (tmp_path / "r" / "steps").rglob("*")) == ["1", "2", "reward.parquet.corrupt"]


def test_the_runs_batches_are_parquet_files_where_its_layout_puts_stage_outputs(tmp_path):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)}})
    batches = batches_for(config)
    assert isinstance(batches, Batches) and type(batches) is StorageBatches
    layout = RunLayout(str(tmp_path), "r")
    for step, stage in [(0, "rollout"), (3, "advantages"), (7, "validation")]:
        assert batches.path(step, stage) == layout.stage_path(step, stage)
