"""The run's `tracking` section: where MLflow records it and what of the final policy it keeps."""

from __future__ import annotations

from pydantic import field_validator

from components.settings import Section


class TrackingConfig(Section):
    tracking_uri: str = "sqlite:///.rlhf/mlflow.db"
    """MLflow tracking URI (SQLite by default; any MLflow server URI works)."""
    experiment: str = "rlhf"
    """MLflow experiment name."""
    registered_model: str | None = None
    """Register the final policy (logged as an MLflow transformers model under `model/`) as a new version of
    this MLflow registered model, tagged with val_reward_end and the run name (e.g. `rlhf-nightly`); None: log
    it, register nothing (`null` on the command line)."""

    @field_validator("registered_model", mode="before")
    @classmethod
    def _a_model_name(cls, value):
        if value == "null":  # a key=value override keeps text as typed
            return None
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("is empty; name an MLflow registered model (e.g. rlhf-nightly), or leave it unset "
                                 "(null) to register nothing")
            if value != value.strip() or not value[0].isalnum() or not all(
                    character.isalnum() or character in " ._-" for character in value):
                raise ValueError("is not a model name: use letters, digits, spaces, '.', '_' or '-', starting with "
                                 "a letter or digit (e.g. rlhf-nightly)")
        return value

    log_model: bool = True
    """Log the final policy into MLflow's artifact store as a transformers model (`model/`), a second full copy
    beside the run folder's export (export/step-N); false: the export only (a large model's copy costs its size
    again on the disk of the artifact store). tracking.registered_model needs it."""

