"""Synthetic tasks written in verl's Parquet row format (prompt / reward_model / extra_info)."""

from components.tasks.arithmetic import (
    ensure_arithmetic_dataset,
    make_arithmetic_rows,
    write_arithmetic_dataset,
)

__all__ = ["ensure_arithmetic_dataset", "make_arithmetic_rows", "write_arithmetic_dataset"]
