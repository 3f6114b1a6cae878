"""`rlhf`: the command line.

    rlhf quickstart                      # tiny model + arithmetic task + GRPO on this machine
    rlhf train configs/quickstart.yaml trainer.total_steps=5
    rlhf config show configs/gpu-1x.yaml actor.optim.lr=1e-5
    rlhf make-tiny-model .rlhf/models/tiny-qwen2
    rlhf make-model smollm2-135m-instruct .rlhf/models/smollm2-135m-instruct   # a real pretrained model
    rlhf make-data arithmetic .rlhf/data/arithmetic
    rlhf resume RUN                      # continue a failed run at its first unfinished stage
    rlhf export RUN [STEP]               # a Hugging Face folder of the trained policy
    rlhf submit quickstart trainer.total_steps=20   # a deployment's run, its config checked first
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

import yaml

from components.tasks.arithmetic import ensure_arithmetic_dataset
from components.tiny import build_tiny_model
from flows.config import build_config, load_config
from flows.runtime.recovery import read_run_record
from flows.runtime.supervision import STOPPING
from flows.runtime.tracking import Tracker, tracking_uri
from flows.tools.compare import add_compare_parser
from flows.tools.doctor import add_doctor_parser
from flows.tools.make import add_make_parsers
from flows.tools.submit import add_submit_parser
from flows.training.preflight import check_device
from flows.training.registry import SHARDED_ROLES, WORKER_ROLES, role_stages
from storage import RunLayout

# The modules above are what the parser needs (torch, MLflow and Prefect's settings come with doctor's). The
# flow's own modules (the stages, the workers, the launcher: transformers and Prefect's engine, seconds more)
# are imported inside the commands that run it, after the config has been checked: a bad one is refused first.

# Sums of two numbers in 0..49: 2,500 distinct problems, 2,000 for training, 200 held out.
QUICKSTART_TASK = {"train_size": 2000, "validation_size": 200, "high": 49, "seed": 0}
DEFAULT_STORAGE_ROOT = ".rlhf/runs"
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _quickstart_config(overrides: list[str]):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return load_config(REPO_CONFIGS / "quickstart.yaml", [f"run.name=quickstart-{stamp}", *overrides])


def _ensure_quickstart_inputs(config) -> None:
    """The quickstart makes its own model and data (nothing can be downloaded)."""
    from flows.runtime.console import quiet_console  # deferred: imports transformers (seconds)

    if not Path(config.model.path, "config.json").exists():
        quiet_console()  # no `Writing model shards` bar
        print(f"building the tiny model at {config.model.path}")
        build_tiny_model(config.model.path)
    data_dir = Path(config.data.train_files[0]).parent
    ensure_arithmetic_dataset(data_dir, **QUICKSTART_TASK)


def run_training(config, start_workers: bool = False) -> dict:
    from flows.training.run import run_training as run  # deferred: the flow's modules (see the imports above)

    summary, flow_run_id = run(config, start_workers=start_workers)
    _print_where_to_look(config, summary, flow_run_id)
    return summary


def _print_where_to_look(config, summary: dict, flow_run_id) -> None:
    from flows.runtime.launcher import DEFAULT_PREFECT_HOME, flow_run_page  # deferred: a flow module, loaded by the run

    bin_dir = Path(sys.executable).parent
    experiment_id = Tracker(config, run_id=summary["mlflow_run_id"]).experiment_id
    prefect_home = os.environ.get("PREFECT_HOME") or str(DEFAULT_PREFECT_HOME.resolve())
    print("\nfinished. Where to look:")
    print(f"  run folder   {summary['run_dir']}")
    if "export_dir" in summary:
        print(f"  final model  {summary['export_dir']}  (Hugging Face folder"
              + ("; also in MLflow under model/)" if "mlflow_model" in summary else ")"))
    print(f"  MLflow run   {summary['mlflow_run_id']}")
    print(f"     view:     {bin_dir}/mlflow ui --backend-store-uri {tracking_uri(config)}")
    print(f"               then http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{summary['mlflow_run_id']}")
    print(f"  Prefect run  {flow_run_id}")
    page = flow_run_page(flow_run_id)  # the link MLflow's prefect.flow_run_url tag holds
    if not os.environ.get("PREFECT_API_URL"):
        print(f"     view:     PREFECT_HOME={prefect_home} {bin_dir}/prefect server start")
        print(f"               then {page}")
    elif page:
        print(f"     view:     {page}")
    labels = {"val_reward_before_warm_start": "validation reward before warm-start",
              "val_reward_start": "validation reward before RL", "val_reward_end": "validation reward at the end"}
    for key, label in labels.items():
        if key in summary:
            print(f"  {label:<37} {summary[key]:.3f}")


def cmd_quickstart(args) -> int:
    config = _quickstart_config(args.overrides)
    check_device(config)  # before the tiny model and the data are built
    _ensure_quickstart_inputs(config)
    run_training(config)
    return 0


def cmd_train(args) -> int:
    run_training(load_config(args.config, args.overrides))
    return 0


def cmd_run(args) -> int:
    run_training(load_config(args.config, ["trainer.execution=workers", *args.overrides]), start_workers=True)
    return 0


def cmd_resume(args) -> int:
    record = read_run_record(RunLayout(args.storage_root, args.run))
    config = build_config(record["config"], ["run.resume=true", "run.overwrite=false", *args.overrides])
    run_training(config, start_workers=config.trainer.execution == "workers")
    return 0


def cmd_worker(args) -> int:
    # deferred: a worker's modules (transformers, Prefect's task worker), imported by this command only
    from flows.runtime.worker import follow, pin_devices, serve_role

    visible = pin_devices(args.devices)  # before anything initialises CUDA in this process
    from flows.runtime.tasks import scoped  # deferred: as the worker's, above
    from flows.training.stages import STAGES  # deferred, as above; importing the stages fills the registry

    code = 0
    try:
        if args.follower:
            follow({name: spec.function for name, spec in STAGES.items() if spec.role == args.role and spec.all_ranks})
        else:  # with --also-serve (a LoRA run's reference in the actor's worker) the other role's stages too
            roles = [args.role, *dict.fromkeys(role for role in args.also_serve if role != args.role)]
            serve_role(args.role, visible, [scoped(spec.task) for role in roles for spec in role_stages(role)],
                       args.heartbeat_dir, preload=args.preload, sharded=args.role in SHARDED_ROLES,
                       also_serve=roles[1:])
    except SystemExit as stop:  # SIGTERM: Prefect's task worker exits; its heartbeat is already removed
        code = stop.code if isinstance(stop.code, int) else 0
    except KeyboardInterrupt:  # SIGTERM or SIGINT (main's handler): stopped on purpose
        code = 0
    except BaseException:  # noqa: BLE001 - printed to the worker's log, then out at once (below)
        traceback.print_exc()
        code = 1
    # At once: a stage still running on one of the task worker's threads would keep the interpreter alive.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_config_show(args) -> int:
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).exists():  # only overrides were given
        path, overrides = None, [path, *overrides]
    config = load_config(path, overrides)
    print(f"# {run_name_note(config, path)}")
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def run_name_note(config, path: str | None) -> str:
    """What the run of this config will be called (`rlhf config show`'s first line, a YAML comment): run.name, with
    run.name_timestamp its start time added; the quickstart's file is run by `rlhf quickstart` under a name of its
    own (_quickstart_config)."""
    run = config.run
    if run.name_timestamp:
        note = f"the run is named {run.name}-<its start time in UTC, YYYYmmdd-HHMMSS> (run.name_timestamp=true)"
    else:
        note = f"the run is named {run.name} (run.name)"
    if path is not None and Path(path).resolve() == (REPO_CONFIGS / "quickstart.yaml").resolve():
        note += "; `rlhf quickstart` runs this file as quickstart-<its start time, YYYYmmdd-HHMMSS>"
    return note


def cmd_export(args) -> int:
    from flows.training.export import export_run  # deferred: imports transformers (seconds), for this command only

    path = export_run(args.storage_root, args.run, step=args.step, output=args.output, tokenizer=args.tokenizer)
    print(path)
    return 0


def add_export_parser(subcommands):
    """Add the `export` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "export", help="write a run's policy as a Hugging Face folder (transformers, vLLM)",
        description="Write the actor weights of a run (safetensors, config.json, generation_config.json) "
                    "with its tokenizer into one folder that AutoModelForCausalLM / AutoTokenizer "
                    ".from_pretrained and vLLM load as is. Prints the folder.\n\nexamples:\n"
                    "  rlhf export exp1                          # latest step -> .rlhf/runs/exp1/export/step-<k>\n"
                    "  rlhf export exp1 40 --output models/exp1-step40\n"
                    "  rlhf export old-run --tokenizer .rlhf/models/tiny-qwen2   # a run without run.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="run name (the folder under --storage-root)")
    parser.add_argument("step", nargs="?", type=int, default=None,
                        help="step whose weights to export (default: the latest committed)")
    parser.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT,
                        help=f"the runs' storage root, a local path or fsspec URI (default: {DEFAULT_STORAGE_ROOT})")
    parser.add_argument("--output", default=None,
                        help="folder to write (default: <storage-root>/<run>/export/step-<k>); replaced only "
                             "when it is an earlier export")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder or hub name (default: model.path from the run's run.json)")
    parser.set_defaults(handler=cmd_export)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__.replace("\n\n", "\n\nexamples:\n", 1),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also RLHF_DEBUG=1); by default an error is one line")
    commands = parser.add_subparsers(dest="command", required=True)
    overrides_help = "key.path=value overrides, e.g. trainer.total_steps=10 actor.optim.lr=1e-5"

    quick = commands.add_parser("quickstart", help="train the tiny model on arithmetic (CPU is fine)",
                                description="Make a tiny model and an arithmetic task, then run GRPO with a local "
                                            "Prefect server and MLflow on SQLite.\n\nexample: rlhf quickstart trainer.total_steps=10",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    quick.add_argument("overrides", nargs="*", help=overrides_help)
    quick.set_defaults(handler=cmd_quickstart)

    train = commands.add_parser("train", help="run the training flow from a config file",
                                description="example: rlhf train configs/quickstart.yaml run.name=exp1 trainer.total_steps=20",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", help="YAML config file (sections as in `rlhf config show`)")
    train.add_argument("overrides", nargs="*", help=overrides_help)
    train.set_defaults(handler=cmd_train)

    run = commands.add_parser("run", help="train with one worker per role, placed on GPUs as configured",
                              description="Validate the placement, start a local Prefect server (unless PREFECT_API_URL "
                                          "is set), one worker per role pinned to its devices, run the flow, stop "
                                          "everything on exit.\n\nexample: rlhf run configs/quickstart.yaml "
                                          "placement.roles.actor=[1] placement.roles.rollout=[0]",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("config", help="YAML config file")
    run.add_argument("overrides", nargs="*", help=overrides_help)
    run.set_defaults(handler=cmd_run)

    resume = commands.add_parser("resume", help="continue a failed or stopped run from its latest checkpoint",
                                 description="Stages whose committed output exists and validates are not run again; "
                                             "the MLflow run continues.\n\nexample: rlhf resume quickstart-20261130-075143",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    resume.add_argument("run", help="run name (the folder under the storage root)")
    resume.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.total_steps=400 to extend it")
    resume.add_argument("--storage-root", default=DEFAULT_STORAGE_ROOT, help=f"where the run folder is (default {DEFAULT_STORAGE_ROOT})")
    resume.set_defaults(handler=cmd_resume)

    worker = commands.add_parser("worker", help="serve one role's stages (a long-lived Prefect task worker)",
                                 description="example: PREFECT_API_URL=http://head:4200/api RLHF_WORKER_DIR=/shared/workers "
                                             "rlhf worker --role actor --devices 0,1")
    worker.add_argument("--role", required=True, choices=WORKER_ROLES)
    worker.add_argument("--devices", default="cpu", help="cpu, or GPU indices relative to CUDA_VISIBLE_DEVICES: 0,1")
    worker.add_argument("--heartbeat-dir", default=None,
                        help="folder (local or fsspec URI) the driver reads liveness from; default $RLHF_WORKER_DIR")
    worker.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="import MODULE before serving (repeatable; `rlhf run` passes vllm to a vLLM rollout's worker)")
    worker.add_argument("--also-serve", action="append", default=[], choices=["reference"], metavar="ROLE",
                        help="also serve ROLE's stages: a LoRA run's reference (model.lora_rank > 0) runs in the actor's "
                             "worker, as the actor's model with its adapter disabled; never beside a reference worker")
    worker.add_argument("--follower", action="store_true", help=argparse.SUPPRESS)  # ranks > 0 of a sharded role
    worker.set_defaults(handler=cmd_worker)

    add_compare_parser(commands)
    add_doctor_parser(commands)
    add_submit_parser(commands)
    add_export_parser(commands)

    config = commands.add_parser("config", help="inspect configurations",
                                 description="example: rlhf config show configs/quickstart.yaml trainer.total_steps=5")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the fully resolved config with defaults",
                                      description="example: rlhf config show configs/quickstart.yaml actor.optim.lr=1e-5")
    show.add_argument("config", nargs="?", help="YAML config file (defaults only when omitted)")
    show.add_argument("overrides", nargs="*", help=overrides_help)
    show.set_defaults(handler=cmd_config_show)

    add_make_parsers(commands)
    return parser


def _raise_on_signal(signum, frame):
    """SIGTERM and SIGINT: unwind like Ctrl-C (workers, the server and the MLflow run are stopped on the way out)."""
    STOPPING.set()
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _stop_line(stop: BaseException) -> tuple[str, int]:
    """`SIGTERM: stopped; the run is resumable: rlhf resume NAME` and the exit code (128 + the signal)."""
    number, message, error = int(signal.SIGINT), "", stop
    for _ in range(10):
        if error is None:
            break
        text = str(error)
        if isinstance(error, KeyboardInterrupt) and text in signal.Signals.__members__:
            number = int(signal.Signals[text])
        elif isinstance(getattr(error, "signal", None), int):  # prefect.exceptions.TerminationSignal
            number = error.signal
        elif isinstance(error, KeyboardInterrupt) and text and not message:
            message = text
        error = error.__cause__ or error.__context__
    return f"{signal.Signals(number).name}: {message or 'stopped'}", 128 + number


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("RLHF_DEBUG", "") not in ("", "0")
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {number: signal.signal(number, _raise_on_signal) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        return args.handler(args)
    except KeyboardInterrupt as stop:
        line, code = _stop_line(stop)
        print(line, file=sys.stderr)
        return code
    except Exception as error:  # user errors (config, data, paths) and failures: one line, no traceback
        if debug:
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not isinstance(error, (ValueError, OSError)):
            message = f"{type(error).__name__}: {message}" if message else type(error).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def entry() -> int:
    """The `rlhf` console script: main(), then out at once after a stop, so that a stage still running on a
    thread of this process (one-process execution) does not keep it alive."""
    code = main()
    if code >= 128:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
