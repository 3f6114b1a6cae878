"""Shared-storage layer: batch schema, run layout, atomic writes, validating reads."""

from storage.io import (
    StageFileError,
    StorageFileError,
    atomic_directory,
    padded_tensor,
    read_json,
    read_stage,
    unpad,
    unpad_arrow,
    validate_stage_file,
    write_bytes_atomic,
    write_json_atomic,
    write_stage,
    write_table_atomic,
)
from storage.layout import COMMITTED_MARKER, LayoutError, RunLayout
from storage.schema import (
    COLUMNS,
    PROMPT_COLUMNS,
    ROLES,
    STAGES,
    Column,
    PromptColumn,
    PromptSchemaError,
    StageSchema,
    describe_schema,
    get_stage,
    validate_prompts_table,
)

__all__ = [
    "COLUMNS", "COMMITTED_MARKER", "PROMPT_COLUMNS", "ROLES", "STAGES",
    "Column", "LayoutError", "PromptColumn", "PromptSchemaError", "RunLayout",
    "StageFileError", "StageSchema", "StorageFileError",
    "atomic_directory", "describe_schema", "get_stage", "padded_tensor", "read_json",
    "read_stage", "unpad", "unpad_arrow", "validate_prompts_table", "validate_stage_file",
    "write_bytes_atomic", "write_json_atomic", "write_stage", "write_table_atomic",
]
