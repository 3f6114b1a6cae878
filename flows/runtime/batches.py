"""A step's batches, behind one seam: what the stages write and read, and what recovery finds committed.

A batch is one stage's output for one step (`rollout`, `reward`, `advantages`, ...), a table with exactly
the stage's declared schema (storage/schema.py). Stages write and read batches through `Batches`
(flows/training/stage_io.py), the driver and recovery ask it which are committed (flows/runtime/recovery.py);
none of them touches the files. The weights do not go this way (flows/runtime/weights/).

`StorageBatches` keeps them as Parquet files of the run folder, `steps/<k>/<stage>.parquet`
(RunLayout.stage_path), written to a temporary sibling and renamed into place: a batch under its final name
is complete, and one whose write failed is not there. Any process on any host with the run's storage reads
them. Another implementation (in memory, say, for a run in one process) is one class with these methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping, Sequence

import pyarrow as pa

from components.distributed import is_writer
from flows.config import Config, layout_for
from storage import RunLayout, read_stage, validate_stage_file, write_stage


class Batches(ABC):
    """Where a run's batches are: one per (step, stage)."""

    @abstractmethod
    def path(self, step: int, stage: str) -> str:
        """Where the batch of `stage` at `step` is (or will be once written): what a stage returns as its path."""

    @abstractmethod
    def write(self, step: int, stage: str, columns: Mapping[str, Any] | pa.Table) -> str:
        """Commit the batch of `stage` at `step` (its declared schema), all of it or nothing; returns its path."""

    @abstractmethod
    def read(self, step: int, stage: str, expected_uids: Sequence[str] | None = None) -> pa.Table:
        """The committed batch, checked against its schema and, when given, the rollout's sample ids in order;
        raises storage.StageFileError when it is missing or does not match."""

    @abstractmethod
    def committed(self, step: int, stage: str) -> bool:
        """Whether the batch was committed (cheap: no read; a stage waiting for another's output polls it)."""

    @abstractmethod
    def readable(self, step: int, stage: str, expected_rows: int | None = None) -> bool:
        """Whether the batch is committed and reads back whole (schema, and `expected_rows` rows when given):
        a resumed run skips the stage that wrote it."""

    @abstractmethod
    def committed_stages(self, step: int) -> set[str]:
        """The stages with a committed batch at `step`."""

    @abstractmethod
    def discard(self, step: int, stage: str, keep_aside: bool = False) -> None:
        """Drop a bad batch so that its stage runs again, or, `keep_aside`, keep it aside (as `<path>.corrupt`)
        where nothing reads it."""


class StorageBatches(Batches):
    """Batches as Parquet files of the run folder on its storage (see the module)."""

    def __init__(self, layout: RunLayout):
        self.layout = layout

    def path(self, step: int, stage: str) -> str:
        return self.layout.stage_path(step, stage)

    def write(self, step: int, stage: str, columns: Mapping[str, Any] | pa.Table) -> str:
        # The other ranks of a sharded role computed the same values: rank 0 alone writes.
        return write_stage(self.layout, step, stage, columns) if is_writer() else self.path(step, stage)

    def read(self, step: int, stage: str, expected_uids: Sequence[str] | None = None) -> pa.Table:
        return read_stage(self.layout, step, stage, expected_rows=None if expected_uids is None else len(expected_uids),
                          expected_uids=expected_uids)

    def committed(self, step: int, stage: str) -> bool:
        return self.layout.fs.exists(self.path(step, stage))

    def readable(self, step: int, stage: str, expected_rows: int | None = None) -> bool:
        return validate_stage_file(self.layout, step, stage, expected_rows=expected_rows)

    def committed_stages(self, step: int) -> set[str]:
        return self.layout.committed_stages(step)

    def discard(self, step: int, stage: str, keep_aside: bool = False) -> None:
        path = self.path(step, stage)
        if keep_aside:
            self.layout.fs.mv(path, f"{path}.corrupt")
        elif self.layout.fs.exists(path):
            self.layout.fs.rm(path)


def batches_for(config: Config) -> Batches:
    """The run's batches: Parquet files of its folder on its storage."""
    return StorageBatches(layout_for(config))
