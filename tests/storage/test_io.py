import os
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import storage.io as storage_io
from storage import (
    COMMITTED_MARKER, RunLayout, StageFileError, atomic_directory, padded_tensor, read_json,
    read_stage, unpad, validate_stage_file, write_json_atomic, write_stage, write_table_atomic,
)

ROLLOUT = {
    "uid": ["u0", "u1", "u2"],
    "group_id": ["g0", "g0", "g1"],
    "prompt_ids": [[1, 2, 3], [1, 2, 3], [7]],
    "response_ids": [[4, 5], [6], []],
    "rollout_logprobs": [[-0.5, -1.25], [-2.0], []],
    "loss_mask": [[1, 1], [1], []],
    "response_text": ["ab", "c", ""],
    "ground_truth": ["2", "2", "x"],
    "data_source": ["gsm8k"] * 3,
    "extra_info": ['{"index": 0}', "null", '{"answer": "#### 2"}'],
    "finish_reason": ["stop", "length", "stop"],
}


@pytest.fixture(params=["local", "memory"])
def layout(request, tmp_path):
    root = str(tmp_path) if request.param == "local" else f"memory://{uuid.uuid4().hex}"
    return RunLayout(root, "run")


def _files_in(fs, directory):
    return sorted(path.rsplit("/", 1)[-1] for path in fs.ls(directory, detail=False))


def test_round_trip_keeps_values_and_exact_types(layout):
    path = write_stage(layout, 0, "rollout", ROLLOUT)
    assert path == layout.stage_path(0, "rollout")
    table = read_stage(layout, 0, "rollout", expected_rows=3, expected_uids=["u0", "u1", "u2"])
    assert table.to_pydict() == ROLLOUT
    assert table.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert table.schema.field("rollout_logprobs").type == pa.list_(pa.float32())
    write_stage(layout, 0, "reward", {"score": [1.0, 0.0, 0.5], "uid": ["u0", "u1", "u2"]})
    reward = read_stage(layout, 0, "reward")
    assert reward.column_names == ["uid", "score"]
    assert reward.schema.field("score").type == pa.float32()
    assert reward.column("score").to_pylist() == [1.0, 0.0, 0.5]
    assert _files_in(layout.fs, layout.step_dir(0)) == ["reward.parquet", "rollout.parquet"]
    assert layout.committed_stages(0) == {"reward", "rollout"}


def test_write_stage_casts_arrow_table_input(layout):
    table = pa.table({"uid": ["a"], "values": pa.array([[1.5, 2.5]], pa.list_(pa.float64()))})
    write_stage(layout, 1, "values", table)
    read = read_stage(layout, 1, "values")
    assert read.schema.field("values").type == pa.list_(pa.float32())
    assert read.column("values").to_pylist() == [[1.5, 2.5]]


@pytest.mark.parametrize("columns, fragment", [
    ({"uid": ["a"]}, "missing ['score'], unexpected []"),
    ({"uid": ["a"], "score": [1.0], "extra": [1]}, "missing [], unexpected ['extra']"),
    ({"uid": ["a", "b"], "score": [1.0]}, "unequal lengths {'uid': 2, 'score': 1}"),
    ({"uid": ["a"], "score": ["high"]}, "column 'score' cannot be stored as float32"),
    ({"uid": [None], "score": [1.0]}, "column 'uid' has 1 null rows"),
])
def test_write_stage_rejects_bad_columns_naming_stage_and_file(layout, columns, fragment):
    with pytest.raises(StageFileError, match="reward.parquet: stage 'reward'") as error:
        write_stage(layout, 0, "reward", columns)
    assert fragment in str(error.value)
    assert not layout.exists(layout.stage_path(0, "reward"))


def test_failed_write_keeps_previous_file_and_leaves_no_temp(layout, monkeypatch):
    write_stage(layout, 2, "reward", {"uid": ["a"], "score": [1.0]})

    def broken_write(table, handle):
        handle.write(b"PAR1 partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(storage_io.pq, "write_table", broken_write)
    with pytest.raises(RuntimeError, match="disk full"):
        write_stage(layout, 2, "reward", {"uid": ["b"], "score": [0.0]})
    monkeypatch.undo()
    assert _files_in(layout.fs, layout.step_dir(2)) == ["reward.parquet"]
    assert read_stage(layout, 2, "reward").column("uid").to_pylist() == ["a"]


def test_write_table_atomic_overwrites_without_temp_files(layout):
    path = f"{layout.run_dir}/x/t.parquet"
    write_table_atomic(pa.table({"a": [1]}), layout.fs, path)
    write_table_atomic(pa.table({"a": [2, 3]}), layout.fs, path)
    assert _files_in(layout.fs, f"{layout.run_dir}/x") == ["t.parquet"]
    with layout.fs.open(path, "rb") as handle:
        assert pq.read_table(handle).column("a").to_pylist() == [2, 3]


def test_truncated_file_raises_naming_path(layout):
    path = write_stage(layout, 0, "reward", {"uid": ["a", "b"], "score": [1.0, 2.0]})
    content = layout.fs.cat_file(path)
    layout.fs.pipe_file(path, content[: len(content) // 2])
    with pytest.raises(StageFileError, match="unreadable parquet") as error:
        read_stage(layout, 0, "reward")
    assert path in str(error.value)
    assert validate_stage_file(layout, 0, "reward") is False


def test_missing_file_raises_and_validates_false(layout):
    with pytest.raises(StageFileError, match="stage file not found") as error:
        read_stage(layout, 4, "values")
    assert str(error.value).startswith(layout.stage_path(4, "values"))
    assert validate_stage_file(layout, 4, "values") is False


def _write_raw(layout, stage, table):
    write_table_atomic(table, layout.fs, layout.stage_path(0, stage))


def test_missing_column_and_wrong_type_name_file(layout):
    _write_raw(layout, "reward", pa.table({"uid": ["a"]}))
    with pytest.raises(StageFileError, match="reward.parquet: missing column 'score'"):
        read_stage(layout, 0, "reward")
    _write_raw(layout, "reward", pa.table({"uid": ["a"], "score": pa.array([1.0], pa.float64())}))
    with pytest.raises(StageFileError,
                       match="reward.parquet: column 'score' has type float64, expected float32"):
        read_stage(layout, 0, "reward")
    _write_raw(layout, "reference", pa.table({"uid": ["a"], "ref_logprobs": [[1, 2]]}))
    with pytest.raises(StageFileError, match="type list<int64>, expected list<float32>"):
        read_stage(layout, 0, "reference")
    assert validate_stage_file(layout, 0, "reference") is False


def test_row_count_and_uid_mismatch_name_file(layout):
    path = write_stage(layout, 0, "reward", {"uid": ["a", "b", "c"], "score": [1.0, 2.0, 3.0]})
    with pytest.raises(StageFileError, match="has 3 rows, expected 4") as error:
        read_stage(layout, 0, "reward", expected_rows=4)
    assert path in str(error.value)
    assert validate_stage_file(layout, 0, "reward", expected_rows=4) is False
    assert validate_stage_file(layout, 0, "reward", expected_rows=3) is True
    with pytest.raises(StageFileError, match=r"2 of 3 uids differ .* first at row 1: "
                                             r"found 'b', expected 'c'") as error:
        read_stage(layout, 0, "reward", expected_uids=["a", "c", "b"])
    assert path in str(error.value)
    with pytest.raises(StageFileError, match="has 3 uids, expected 2"):
        read_stage(layout, 0, "reward", expected_uids=["a", "b"])


def test_read_stage_returns_declared_order_and_drops_extra_columns(layout):
    _write_raw(layout, "reward", pa.table({
        "note": ["x"], "score": pa.array([0.5], pa.float32()), "uid": ["a"]}))
    assert read_stage(layout, 0, "reward").column_names == ["uid", "score"]


def test_padded_tensor_right_and_left():
    rows = [[1, 2, 3], [4], []]
    values, mask = padded_tensor(rows, pad_value=0, dtype=torch.long)
    assert torch.equal(values, torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0]]))
    assert torch.equal(mask, torch.tensor([[1., 1., 1.], [1., 0., 0.], [0., 0., 0.]]))
    assert mask.dtype == torch.float32
    values, mask = padded_tensor(rows, pad_value=-1, dtype=torch.long, side="left", length=4)
    assert torch.equal(values, torch.tensor([[-1, 1, 2, 3], [-1, -1, -1, 4], [-1, -1, -1, -1]]))
    assert torch.equal(mask, torch.tensor([[0., 1., 1., 1.], [0., 0., 0., 1.], [0., 0., 0., 0.]]))


def test_padded_tensor_from_sliced_chunked_arrow_matches_python():
    array = pa.array([[9.0], [0.5, 1.5], [2.5]], pa.list_(pa.float32()))
    chunked = pa.chunked_array([array.slice(1, 1), array.slice(2, 1)])
    values, mask = padded_tensor(chunked, pad_value=0.0, dtype=torch.float32)
    assert torch.equal(values, torch.tensor([[0.5, 1.5], [2.5, 0.0]]))
    assert torch.equal(mask, torch.tensor([[1., 1.], [1., 0.]]))
    expected = padded_tensor([[0.5, 1.5], [2.5]], 0.0, torch.float32)
    assert torch.equal(values, expected[0]) and torch.equal(mask, expected[1])


def test_padded_tensor_errors_and_empty_batch():
    with pytest.raises(ValueError, match="row 1 has 3 elements, longer than length=2"):
        padded_tensor([[1], [1, 2, 3]], 0, torch.long, length=2)
    with pytest.raises(ValueError, match="side='middle' is invalid"):
        padded_tensor([[1]], 0, torch.long, side="middle")
    values, mask = padded_tensor([], 0, torch.long, length=5)
    assert values.shape == (0, 5) and mask.shape == (0, 5)


def test_unpad_inverts_padding_and_feeds_write_stage(layout):
    rows = [[0.25, -1.0, 3.0], [], [7.5]]
    for side in ("right", "left"):
        values, mask = padded_tensor(rows, 0.0, torch.float32, side=side)
        assert unpad(values, mask) == rows
    write_stage(layout, 0, "values", {"uid": ["a", "b", "c"], "values": unpad(values, mask)})
    assert read_stage(layout, 0, "values").column("values").to_pylist() == rows


def test_unpad_arrow_gives_the_same_rows_as_an_arrow_array_and_feeds_write_stage(layout):
    rows = [[0.25, -1.0, 3.0], [], [7.5]]
    for side in ("right", "left"):
        values, mask = padded_tensor(rows, 0.0, torch.float32, side=side)
        array = storage_io.unpad_arrow(values, mask)
        assert array.type == pa.list_(pa.float32()) and array.to_pylist() == rows
        again, again_mask = padded_tensor(array, 0.0, torch.float32, side=side)  # the round trip
        assert torch.equal(again, values) and torch.equal(again_mask, mask)
    write_stage(layout, 0, "values", {"uid": ["a", "b", "c"], "values": storage_io.unpad_arrow(values, mask)})
    assert read_stage(layout, 0, "values").column("values").to_pylist() == rows
    with pytest.raises(ValueError, match="equal"):
        storage_io.unpad_arrow(values, mask[:, :1])


def test_json_helpers(layout):
    path = f"{layout.run_dir}/state.json"
    write_json_atomic(layout.fs, path, {"step": 3, "done": ["rollout"]})
    assert read_json(layout.fs, path) == {"step": 3, "done": ["rollout"]}
    layout.fs.pipe_file(path, b"{not json")
    with pytest.raises(ValueError, match="state.json: not valid JSON"):
        read_json(layout.fs, path)


def test_atomic_directory_publishes_files_and_marker(layout):
    target = layout.weights_dir("actor", 1)
    for generation in ("first", "second"):
        with atomic_directory(layout.fs, target) as local:
            assert os.path.isdir(local)
            os.makedirs(os.path.join(local, "sub"))
            with open(os.path.join(local, "sub", "model.bin"), "w") as handle:
                handle.write(generation)
            if generation == "first":
                with open(os.path.join(local, "stale.txt"), "w") as handle:
                    handle.write("old")
        assert layout.fs.cat_file(f"{target}/sub/model.bin") == generation.encode()
    # The second publish replaced the first entirely: no stale files survive.
    assert _files_in(layout.fs, target) == [COMMITTED_MARKER, "sub"]
    assert _files_in(layout.fs, f"{layout.run_dir}/weights/actor") == ["1"]
    assert layout.latest_weights("actor") == (1, target)


def test_atomic_directory_publishes_nothing_on_exception(layout):
    target = layout.weights_dir("critic", 4)
    with pytest.raises(RuntimeError, match="save failed"):
        with atomic_directory(layout.fs, target) as local:
            with open(os.path.join(local, "model.bin"), "w") as handle:
                handle.write("partial")
            raise RuntimeError("save failed")
    assert not os.path.exists(local)
    assert not layout.exists(target)
    assert layout.latest_weights("critic") is None
    parent = f"{layout.run_dir}/weights/critic"
    assert not layout.exists(parent) or _files_in(layout.fs, parent) == []
