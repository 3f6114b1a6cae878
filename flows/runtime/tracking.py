"""MLflow tracking: one MLflow run per training run, driven by explicit run ids.

The flow uses an `MlflowClient` with the run id rather than mlflow's global "active run", because
stages finish on Prefect's worker threads and the global run is thread-local.

Besides the config and the metrics, a run records its lineage (the data files its globs matched, the run and
step `model.from_run` started from: `log_lineage`), the Prefect flow run it ran in (`flow_run_tags`), and its
final policy as an MLflow transformers model (`log_model`), optionally registered as a new version of a
registered model (`register_model`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import logging
import math
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import fsspec
import mlflow
import mlflow.transformers
import yaml
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import infer_signature
from mlflow.tracking import MlflowClient
from mlflow.tracking._tracking_service.utils import _tracking_store_registry
from mlflow.utils.uri import get_uri_scheme
from prefect.runtime import flow_run as prefect_flow_run
from prefect.utilities.urls import url_for

from components.placement import ROLES
from flows.config import Config, flatten
from storage.layout import local_write_problem

MAX_PARAM_LENGTH = 6000
RUN_NAME_TAG = "rlhf.run_name"
MODEL_ARTIFACT_PATH = "model"
LINEAGE_FILE = "lineage.json"


def tracking_uri(config: Config) -> str:
    """The configured URI, with a relative SQLite path made absolute (and its folder created)."""
    uri = config.tracking.tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        path = Path(uri[len(prefix):]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        uri = prefix + str(path)
    return uri


def check_tracking_uri(uri: str, field: str = "tracking.tracking_uri") -> None:
    """The URI names a tracking store MLflow has (its scheme), and a SQLite or file store's folder can be created
    and written: ValueError naming `field` otherwise. Nothing is created and no server is contacted."""
    shown = f"{field}={redact_credentials(uri)!r}"
    if uri in ("databricks", "databricks-uc", "uc"):
        return
    if "://" not in uri and ":" in uri.split("/", 1)[0]:  # "sqlite:mlflow.db", "http:host": a scheme without //
        raise ValueError(f"{shown} is not a URI MLflow reads (no '//' after {uri.split(':', 1)[0] + ':'!r}); e.g. "
                         "sqlite:///.rlhf/mlflow.db, http://host:5000 or a local folder")
    try:
        scheme = get_uri_scheme(uri)
        _tracking_store_registry.get_store_builder(uri)  # which store class; builds nothing
    except MlflowException:
        schemes = ", ".join(sorted(name for name in getattr(_tracking_store_registry, "_registry", {}) if name))
        raise ValueError(f"{shown}: MLflow has no tracking store for the scheme {uri.split('://', 1)[0]!r}; use "
                         f"one of {schemes} (e.g. sqlite:///.rlhf/mlflow.db or http://host:5000)") from None
    if scheme == "sqlite":
        if not uri.startswith("sqlite:///") or uri == "sqlite:///":
            raise ValueError(f"{shown} is not a SQLite URI MLflow reads; use sqlite:///<relative path> or "
                             "sqlite:////<absolute path> (e.g. sqlite:///.rlhf/mlflow.db)")
        folder = Path(uri[len("sqlite:///"):]).parent
    elif scheme in ("http", "https"):
        if not uri.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(f"{shown} names no host; e.g. http://127.0.0.1:5000")
        return
    elif scheme in ("", "file"):
        folder = Path(uri.split("://", 1)[1] if scheme else uri)
    else:
        return
    if problem := local_write_problem(folder):
        raise ValueError(f"{shown}: the store's folder {str(folder)!r} is not writable: {problem}; give a path "
                         "you can write, e.g. sqlite:///.rlhf/mlflow.db")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _assignment(value) -> str:
    """A placement entry as text: GPU indices joined by commas, or "cpu" / "auto"."""
    return ",".join(str(index) for index in value) if isinstance(value, list) else str(value)


CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def redact_credentials(text: str) -> str:
    """URIs with a user or password (`s3://key:secret@bucket`, `postgresql://user:pw@host/db`) as
    `scheme://***@...`: what goes to MLflow (params, tags, config artifacts) never holds them."""
    return CREDENTIALS.sub(lambda match: f"{match['scheme']}***@", text)


def placement_summary(config: Config) -> str:
    """One line of where each role is placed, e.g. "rollout=0 actor=1 critic=0 reference=1 reward=cpu".

    Read from config.placement only (roles not listed show placement.default; no device probing), in
    the order of components.placement.ROLES.
    """
    placement = config.placement
    return " ".join(f"{role}={_assignment(placement.roles.get(role, placement.default))}" for role in ROLES)


def run_description(config: Config) -> str:
    """The run's MLflow description (tag mlflow.note.content): one paragraph of markdown."""
    warm = (f" after a {config.warm_start.steps}-step supervised warm-start" if config.warm_start.steps else "")
    critic = " with a critic" if config.uses_critic else ""
    return (f"**{config.run.name}**: `{config.algorithm.adv_estimator}`{critic} post-training of "
            f"`{config.model.path}` for {config.trainer.total_steps} RL steps{warm}, "
            f"{config.data.prompts_per_step} prompts x {config.rollout.n} samples per step, "
            f"execution `{config.trainer.execution}`, placement `{placement_summary(config)}`; "
            f"stage files under `{config.run.storage_root}/{config.run.name}`.")


def run_tags(config: Config) -> dict[str, str]:
    """The tags a new training run gets."""
    tags = {RUN_NAME_TAG: config.run.name, "rlhf.algorithm": config.algorithm.adv_estimator,
            "mlflow.source.git.commit": _git_commit(), "rlhf.storage_root": config.run.storage_root,
            "rlhf.placement": placement_summary(config), "rlhf.execution": config.trainer.execution,
            "mlflow.note.content": run_description(config)}
    return {key: redact_credentials(value) for key, value in tags.items()}


def config_yaml(config: Config) -> str:
    """The resolved config as YAML (what `rlhf config show` prints); build_config reads it back."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _sqlite_store_missing(uri: str) -> bool:
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return False
    path = uri[len(prefix):]
    return bool(path) and path != ":memory:" and not Path(path).exists()


@contextlib.contextmanager
def _first_use_of_store(uri: str) -> Iterator[None]:
    """One process at a time creates a SQLite store's schema and an experiment: two runs starting at once on a
    fresh store otherwise race in MLflow's migration ("one migration expected to match one row") or both create
    the experiment. A lock file beside the database; other stores need none."""
    prefix = "sqlite:///"
    path = uri[len(prefix):] if uri.startswith(prefix) else ""
    if not path or path == ":memory:" or not Path(path).parent.is_dir():
        yield
        return
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def find_active_run_id(config: Config) -> str | None:
    """The newest RUNNING MLflow run tagged rlhf.run_name == config.run.name in config.tracking.experiment.

    None when there is none (or the SQLite store or the experiment does not exist yet: nothing is
    created). Workers use it to attach their system metrics to the run the driver started.
    """
    uri = config.tracking.tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())  # like tracking_uri(), without mkdir
    if _sqlite_store_missing(uri):
        return None
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`{RUN_NAME_TAG}` = '{config.run.name}' "
                                            "and attributes.status = 'RUNNING'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def flow_run_tags() -> dict[str, str]:
    """Tags pointing a training's MLflow run to the Prefect flow run this code runs in: prefect.flow_run_id,
    prefect.flow_run_name and prefect.flow_run_url (its page in the Prefect UI, when a UI or API URL is
    set). None outside a flow run."""
    flow_run_id = prefect_flow_run.id
    if not flow_run_id:
        return {}
    tags = {"prefect.flow_run_id": str(flow_run_id)}
    if name := prefect_flow_run.name:
        tags["prefect.flow_run_name"] = str(name)
    if url := url_for("flow-run", obj_id=str(flow_run_id)):
        tags["prefect.flow_run_url"] = url
    return tags


def lineage_params(lineage: dict) -> dict[str, str]:
    """MLflow params of a run's lineage (flows/training/preflight.py, `InputSummary.lineage`): for each list of
    data files, `lineage.data.<field>` (each resolved file as "path (size bytes, modified time)"; cut with a note
    past MLflow's param length, lineage.json has them all), `.count` and `.bytes`; with model.from_run,
    `lineage.from_run` and `lineage.from_run.step` (the step of the weights the run started from)."""
    params: dict[str, str] = {}
    for field, files in (lineage.get("data") or {}).items():
        listed = "; ".join(f"{entry['path']} ({entry.get('size')} bytes, {entry.get('modified')})" for entry in files)
        if len(listed) > MAX_PARAM_LENGTH:
            note = f" ... ({len(files)} files; {LINEAGE_FILE} lists them all)"
            listed = listed[: MAX_PARAM_LENGTH - len(note)] + note
        params[f"lineage.data.{field}"] = listed
        params[f"lineage.data.{field}.count"] = str(len(files))
        params[f"lineage.data.{field}.bytes"] = str(sum(entry.get("size") or 0 for entry in files))
    if start := lineage.get("from_run"):
        params["lineage.from_run"] = str(start["run"])
        params["lineage.from_run.step"] = str(start["step"])
    return {key: redact_credentials(value) for key, value in params.items()}


def _model_requirements() -> list[str]:
    """What serving the logged model needs: the installed transformers and torch (a local build tag such as
    +cpu left out: the same release of another build serves it)."""
    return [f"{package}=={importlib.metadata.version(package).split('+')[0]}" for package in ("transformers", "torch")]


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Only errors from that logger for a while."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _local_folder(folder: str | Path) -> Iterator[Path]:
    """`folder` as a local path: itself, or a temporary copy of a remote (fsspec URI) one. FileNotFoundError
    when it is not a folder."""
    fs, root = fsspec.core.url_to_fs(str(folder))
    if not fs.isdir(root):
        raise FileNotFoundError(f"cannot log model folder {str(folder)!r}: not a folder")
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        yield Path(root)
        return
    with tempfile.TemporaryDirectory(prefix="rlhf-model-") as temporary:
        fs.get(root.rstrip("/") + "/", temporary, recursive=True)
        yield Path(temporary)


def artifact_location(uri: str) -> str | None:
    """With a SQLite store, artifacts go beside the database (`<db folder>/mlartifacts/`) instead of
    `./mlruns` under whatever the working directory is; servers choose their own."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri[len(prefix):]).parent / "mlartifacts").resolve().as_uri()


class Tracker:
    """Logs params, per-step metrics, sample tables and artifacts to one MLflow run."""

    def __init__(self, config: Config, run_id: str | None = None):
        self.uri = tracking_uri(config)
        with _first_use_of_store(self.uri):  # runs started at once (a schedule beside a manual run) share the store
            self.client = MlflowClient(tracking_uri=self.uri)
            mlflow.set_tracking_uri(self.uri)
            experiment = self.client.get_experiment_by_name(config.tracking.experiment)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(config.tracking.experiment,
                                                                artifact_location=artifact_location(self.uri)))
        if run_id is None:
            run = self.client.create_run(experiment_id, run_name=config.run.name, tags=run_tags(config))
            run_id = run.info.run_id
            self._log_params(config, run_id)
        self.run_id = run_id
        self.experiment_id = experiment_id

    def _log_params(self, config: Config, run_id: str) -> None:
        params = [Param(key, redact_credentials(str(value))[:MAX_PARAM_LENGTH]) for key, value in flatten(config).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start : start + 100])
        self.client.log_text(run_id, redact_credentials(config.model_dump_json(indent=2)), "config.json")
        self.client.log_text(run_id, redact_credentials(config_yaml(config)), "config.yaml")

    def log_params(self, params: dict[str, str]) -> None:
        """Params beyond the config (a resumed run already has them: MLflow refuses to change a param)."""
        logged = self.client.get_run(self.run_id).data.params
        fresh = [Param(key, str(value)[:MAX_PARAM_LENGTH]) for key, value in params.items() if key not in logged]
        if fresh:
            self.client.log_batch(self.run_id, params=fresh)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in metrics.items()
                   if isinstance(value, (int, float)) and math.isfinite(float(value))]
        for start in range(0, len(entries), 500):
            self.client.log_batch(self.run_id, metrics=entries[start : start + 500])

    def log_table(self, columns: dict[str, list], artifact_file: str) -> None:
        self.client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

    def log_model_folder(self, local_dir: str | Path, artifact_path: str = "model") -> None:
        """Log a folder (e.g. the final actor weights, `weights/actor/<last>`) as run artifacts.

        `local_dir` may also be an fsspec URI (the storage root may be remote): it is then copied
        to a temporary folder first. Raises FileNotFoundError when the folder does not exist.
        """
        with _local_folder(local_dir) as local:
            self.client.log_artifacts(self.run_id, str(local), artifact_path)

    def log_model(self, folder: str | Path, generation_params: dict | None = None,
                  artifact_path: str = MODEL_ARTIFACT_PATH) -> str:
        """Log a Hugging Face causal-LM folder (weights, config, tokenizer: `rlhf export`'s) as an MLflow
        transformers model (task text-generation) under `artifact_path`; return its URI, runs:/<run id>/<path>.

        `mlflow.transformers.load_model(uri)` gives a text-generation pipeline, `mlflow.pyfunc.load_model(uri)`
        a model whose predict takes prompts and, as params, `generation_params` (these values by default).
        `folder` may be an fsspec URI (copied to a temporary folder first). The checkpoint is copied as it is
        (no model is loaded) and the requirements are the installed transformers and torch (not inferred by
        loading the model in a subprocess, which takes minutes for a large one).
        """
        signature = (infer_signature("prompt", "generated text", params=generation_params)
                     if generation_params else None)
        with _local_folder(folder) as local, tempfile.TemporaryDirectory(prefix="rlhf-mlflow-model-") as staging:
            saved = Path(staging) / "model"
            with _quiet("mlflow.transformers"):  # its model card and license are looked up on the Hub, by path
                mlflow.transformers.save_model(str(local), str(saved), task="text-generation", signature=signature,
                                               pip_requirements=_model_requirements())
            self.client.log_artifacts(self.run_id, str(saved), artifact_path)
        return f"runs:/{self.run_id}/{artifact_path}"

    def register_model(self, name: str, tags: dict[str, str], artifact_path: str = MODEL_ARTIFACT_PATH,
                       timeout_s: float = 300.0) -> str:
        """Register the model logged under `artifact_path` (log_model) as a new version of the registered model
        `name` (created when new), with `tags`; return the version. A run registers one version: a version of
        this run already there (a run resumed after it registered) is kept and its tags updated. The MLflow
        run gets the tag rlhf.registered_model = "<name>/<version>"."""
        source = f"runs:/{self.run_id}/{artifact_path}"
        try:
            self.client.create_registered_model(name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        tags = {key: redact_credentials(str(value)) for key, value in tags.items()}
        earlier = [version for version in self.client.search_model_versions(
                       f"name = '{name}' and run_id = '{self.run_id}'") if version.source == source]
        if earlier:
            version = min(earlier, key=lambda version: int(version.version))
            for key, value in tags.items():
                self.client.set_model_version_tag(name, version.version, key, value)
        else:
            version = self.client.create_model_version(name, source, run_id=self.run_id, tags=tags)
        deadline = time.monotonic() + timeout_s  # a tracking server may copy the files first
        while version.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
            time.sleep(1.0)
            version = self.client.get_model_version(name, version.version)
        if version.status != "READY":
            raise RuntimeError(f"tracking.registered_model={name!r}: version {version.version} is "
                               f"{version.status} ({version.status_message or 'no message'})")
        self.set_tags({"rlhf.registered_model": f"{name}/{version.version}"})
        return str(version.version)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set (or replace) tags of the run."""
        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(key, redact_credentials(str(value)))
                                                     for key, value in tags.items()])

    def log_lineage(self, lineage: dict) -> None:
        """What the run started from (see lineage_params) as params, and in full as the artifact lineage.json."""
        self.log_params(lineage_params(lineage))
        self.client.log_text(self.run_id, redact_credentials(json.dumps(lineage, indent=2)), LINEAGE_FILE)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

