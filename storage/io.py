"""Atomic writes and validating reads of stage files, weights and JSON.

Readers on other machines may look at shared storage at any moment, and a
task may be killed mid-write. So nothing is ever written in place: files go
to a temporary sibling and are renamed into their final name, and weight
directories become visible only together with their `_COMMITTED` marker.
A file that exists under its final name is therefore complete — which is what
stage-level resumption (validate_stage_file) relies on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from fsspec.implementations.local import LocalFileSystem

from storage.layout import COMMITTED_MARKER, RunLayout
from storage.schema import get_stage, type_name


class StorageFileError(ValueError):
    """A file on shared storage is missing or unusable; the message names it."""


class StageFileError(StorageFileError):
    """A stage parquet file is missing, corrupt, or does not match its schema."""


def _parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path else "."


def _temporary_sibling(path: str) -> str:
    return f"{path.rstrip('/')}.tmp-{uuid.uuid4().hex}"


def _publish_file(fs, write, path: str) -> str:
    """Run `write(file_object)` into a temp sibling, then rename it to `path`."""
    fs.makedirs(_parent(path), exist_ok=True)
    temporary = _temporary_sibling(path)
    try:
        with fs.open(temporary, "wb") as handle:
            write(handle)
        if isinstance(fs, LocalFileSystem):
            # Atomic on POSIX and overwrites the old file (fs.mv may copy instead).
            os.replace(fs._strip_protocol(temporary), fs._strip_protocol(path))
        else:
            fs.mv(temporary, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.exists(temporary):
                fs.rm(temporary)
        raise
    return path


def write_table_atomic(table: pa.Table, fs, path: str) -> str:
    return _publish_file(fs, lambda handle: pq.write_table(table, handle), path)


def write_json_atomic(fs, path: str, obj) -> str:
    return write_bytes_atomic(fs, path, json.dumps(obj, indent=2, sort_keys=True).encode("utf-8"))


def write_bytes_atomic(fs, path: str, payload: bytes) -> str:
    return _publish_file(fs, lambda handle: handle.write(payload), path)


def read_json(fs, path: str):
    try:
        with fs.open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8"))
    except FileNotFoundError:
        raise StorageFileError(f"{path}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StorageFileError(f"{path}: not valid JSON ({error})") from None


# ---------------------------------------------------------------------------
# Stage files
# ---------------------------------------------------------------------------

def _null_problem(column: pa.ChunkedArray | pa.Array) -> str | None:
    # Nulls would silently turn into NaN/0 in tensors downstream; every
    # declared column is dense, so any null is a writer bug.
    if column.null_count:
        return f"{column.null_count} null rows"
    if pa.types.is_list(column.type):
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        inner_nulls = sum(chunk.flatten().null_count for chunk in chunks)
        if inner_nulls:
            return f"{inner_nulls} null elements inside lists"
    return None


def _columns_to_table(columns: Mapping[str, object] | pa.Table, stage: str,
                      schema: pa.Schema, path: str) -> pa.Table:
    given = list(columns.column_names if isinstance(columns, pa.Table) else columns.keys())
    missing = [name for name in schema.names if name not in given]
    extra = [name for name in given if name not in schema.names]
    if missing or extra:
        raise StageFileError(
            f"{path}: stage {stage!r} columns do not match its schema "
            f"(missing {missing}, unexpected {extra}); expected exactly {schema.names}"
        )
    arrays = []
    for field in schema:
        values = columns.column(field.name) if isinstance(columns, pa.Table) else columns[field.name]
        try:
            if isinstance(values, (pa.Array, pa.ChunkedArray)):
                arrays.append(values.cast(field.type))
            else:
                arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowException, TypeError, ValueError) as error:
            raise StageFileError(
                f"{path}: stage {stage!r} column {field.name!r} cannot be stored as "
                f"{type_name(field.type)} ({error})"
            ) from None
    lengths = {field.name: len(array) for field, array in zip(schema, arrays)}
    if len(set(lengths.values())) > 1:
        raise StageFileError(f"{path}: stage {stage!r} columns have unequal lengths {lengths}")
    for field, array in zip(schema, arrays):
        problem = _null_problem(array)
        if problem:
            raise StageFileError(f"{path}: stage {stage!r} column {field.name!r} has {problem}")
    return pa.Table.from_arrays(arrays, schema=schema)


def write_stage(layout: RunLayout, step: int, stage: str,
                columns: Mapping[str, object] | pa.Table) -> str:
    """Write one stage file with exactly the stage's declared schema."""
    path = layout.stage_path(step, stage)
    table = _columns_to_table(columns, stage, get_stage(stage).arrow_schema(), path)
    return write_table_atomic(table, layout.fs, path)


def _read_parquet(fs, path: str) -> pa.Table:
    if not fs.exists(path):
        raise StageFileError(f"{path}: stage file not found")
    try:
        with fs.open(path, "rb") as handle:
            return pq.read_table(handle)
    except (pa.ArrowException, OSError, EOFError, ValueError) as error:
        raise StageFileError(f"{path}: unreadable parquet (truncated or corrupt?): {error}") from None


def _check_uids(path: str, actual: list[str], expected: list[str]) -> None:
    if len(actual) != len(expected):
        raise StageFileError(f"{path}: has {len(actual)} uids, expected {len(expected)}")
    mismatches = [index for index, (got, want) in enumerate(zip(actual, expected)) if got != want]
    if mismatches:
        first = mismatches[0]
        raise StageFileError(
            f"{path}: {len(mismatches)} of {len(expected)} uids differ from the expected order; "
            f"first at row {first}: found {actual[first]!r}, expected {expected[first]!r}"
        )


def read_stage(layout: RunLayout, step: int, stage: str,
               expected_rows: int | None = None,
               expected_uids: Sequence[str] | None = None) -> pa.Table:
    """Read and validate a stage file; columns come back in declared order."""
    path = layout.stage_path(step, stage)
    schema = get_stage(stage).arrow_schema()
    table = _read_parquet(layout.fs, path)
    for field in schema:
        if field.name not in table.column_names:
            raise StageFileError(
                f"{path}: missing column {field.name!r}; found {table.column_names}"
            )
        found = table.schema.field(field.name).type
        if found != field.type:
            raise StageFileError(
                f"{path}: column {field.name!r} has type {type_name(found)}, "
                f"expected {type_name(field.type)}"
            )
        problem = _null_problem(table.column(field.name))
        if problem:
            raise StageFileError(f"{path}: column {field.name!r} has {problem}")
    table = table.select(schema.names)
    if expected_rows is not None and table.num_rows != expected_rows:
        raise StageFileError(f"{path}: has {table.num_rows} rows, expected {expected_rows}")
    if expected_uids is not None:
        _check_uids(path, table.column("uid").to_pylist(), list(expected_uids))
    return table


def validate_stage_file(layout: RunLayout, step: int, stage: str,
                        expected_rows: int | None = None) -> bool:
    """True when the committed stage file exists and validates (stage can be skipped)."""
    try:
        read_stage(layout, step, stage, expected_rows=expected_rows)
    except StageFileError:
        return False
    return True


# ---------------------------------------------------------------------------
# Ragged lists <-> padded tensors
# ---------------------------------------------------------------------------

def _flatten_rows(rows) -> tuple[np.ndarray, np.ndarray]:
    """Return (flat values, per-row lengths) for arrow list arrays or python rows."""
    if isinstance(rows, pa.ChunkedArray):
        rows = rows.combine_chunks() if rows.num_chunks else pa.array([], rows.type)
    if isinstance(rows, (pa.ListArray, pa.LargeListArray)):
        if rows.null_count:
            raise ValueError(f"padded_tensor: input has {rows.null_count} null rows")
        flat = rows.flatten()  # respects slicing, unlike .values
        if flat.null_count:
            raise ValueError(f"padded_tensor: input has {flat.null_count} null elements")
        lengths = np.diff(np.asarray(rows.offsets, dtype=np.int64))
        return flat.to_numpy(zero_copy_only=False), lengths
    rows = [row.detach().cpu().numpy() if isinstance(row, torch.Tensor) else np.asarray(row)
            for row in rows]
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    flat = np.concatenate(rows) if rows else np.zeros(0)
    return flat, lengths


def padded_tensor(rows, pad_value, dtype: torch.dtype, side: str = "right",
                  length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad ragged rows into a [B, L] tensor plus a float32 mask (1 = real token)."""
    if side not in ("right", "left"):
        raise ValueError(f"padded_tensor: side={side!r} is invalid; expected 'right' or 'left'")
    flat, lengths = _flatten_rows(rows)
    longest = int(lengths.max()) if len(lengths) else 0
    if length is None:
        length = longest
    elif longest > length:
        row = int(np.argmax(lengths))
        raise ValueError(
            f"padded_tensor: row {row} has {longest} elements, longer than length={length}"
        )
    batch = len(lengths)
    row_index = np.repeat(np.arange(batch), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if batch else np.zeros(0, np.int64)
    column_index = np.arange(len(flat)) - np.repeat(starts, lengths)
    if side == "left":
        column_index += np.repeat(length - lengths, lengths)
    output = torch.full((batch, length), pad_value, dtype=dtype)
    mask = torch.zeros((batch, length), dtype=torch.float32)
    rows_t, columns_t = torch.from_numpy(row_index), torch.from_numpy(column_index)
    output[rows_t, columns_t] = torch.tensor(flat).to(dtype)  # copy: arrow buffers are read-only
    mask[rows_t, columns_t] = 1.0
    return output, mask


def _kept(tensor: torch.Tensor, mask: torch.Tensor, caller: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the values where mask is set, row by row, on the host; how many per row)."""
    if tensor.shape != mask.shape or tensor.dim() != 2:
        raise ValueError(
            f"{caller}: tensor {tuple(tensor.shape)} and mask {tuple(mask.shape)} "
            "must be equal [B, L] shapes"
        )
    keep = mask.detach().cpu() != 0
    return tensor.detach().cpu()[keep], keep.sum(dim=1)


def unpad(tensor: torch.Tensor, mask: torch.Tensor) -> list[list]:
    """Inverse of padded_tensor: per row, the values where mask is set, in order."""
    values, lengths = _kept(tensor, mask, "unpad")
    return [chunk.tolist() for chunk in torch.split(values, lengths.tolist())]


def unpad_arrow(tensor: torch.Tensor, mask: torch.Tensor) -> pa.ListArray:
    """`unpad` straight into an Arrow list array (float32 values; no Python lists): for stage files."""
    values, lengths = _kept(tensor, mask, "unpad_arrow")
    offsets = np.concatenate([[0], np.cumsum(lengths.numpy())]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values.float().numpy(), pa.float32()))


# ---------------------------------------------------------------------------
# Directories (model weights, checkpoints)
# ---------------------------------------------------------------------------

def _write_marker(directory: str) -> None:
    with open(os.path.join(directory, COMMITTED_MARKER), "w") as handle:
        handle.write("committed\n")


def _publish_local_directory(temporary: str, path: str) -> None:
    _write_marker(temporary)
    if not os.path.exists(path):
        os.replace(temporary, path)
        return
    # A directory cannot be renamed over a non-empty one, so the old copy is
    # moved aside first; readers briefly see no directory, never a mixed one.
    old = f"{path}.old-{uuid.uuid4().hex}"
    os.replace(path, old)
    os.replace(temporary, path)
    shutil.rmtree(old, ignore_errors=True)


def _publish_remote_directory(fs, local: str, path: str) -> None:
    marker = f"{path.rstrip('/')}/{COMMITTED_MARKER}"
    if fs.exists(path):
        # Drop the marker before the contents so nobody loads a half-replaced dir.
        if fs.exists(marker):
            fs.rm(marker)
        fs.rm(path, recursive=True)
    fs.makedirs(_parent(path), exist_ok=True)
    if os.listdir(local):
        fs.put(local, path, recursive=True)  # target absent: contents land in `path`
    fs.pipe_file(marker, b"committed\n")  # last, so the marker implies completeness


@contextlib.contextmanager
def atomic_directory(fs, path: str) -> Iterator[str]:
    """Yield a local directory to fill; publish it to `path` only on success."""
    path = path.rstrip("/")
    if isinstance(fs, LocalFileSystem):
        path = fs._strip_protocol(path)  # plain OS path: os.replace below, not fsspec
        os.makedirs(_parent(path), exist_ok=True)
        temporary = _temporary_sibling(path)  # same filesystem, so rename is atomic
        os.makedirs(temporary)
        try:
            yield temporary
            _publish_local_directory(temporary, path)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
        return
    with tempfile.TemporaryDirectory(prefix="atomic-dir-") as local:
        yield local
        _publish_remote_directory(fs, local, path)
