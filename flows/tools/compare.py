"""`rlhf compare`: side-by-side view of training runs recorded in MLflow.

    rlhf compare                         # the 10 newest runs of experiment "rlhf"
    rlhf compare exp1 exp2 --output .rlhf/compare.png
    rlhf compare 3f2a9c...  --metric critic/score/mean --metric actor/entropy

Works offline against the tracking store (an `MlflowClient`, no server needed): lists the params
that differ between the runs, each metric's final and best value, and plots reward, KL, response
length and update size against the step.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from flows.config import build_config

# mlflow and matplotlib are imported when the command runs, not when the CLI builds its parser from this
# module: `rlhf --help` would otherwise take seconds.

DEFAULT_EXPERIMENT = "rlhf"
DEFAULT_TRACKING_URI = "sqlite:///.rlhf/mlflow.db"
DEFAULT_OUTPUT = ".rlhf/compare.png"
MAX_RUNS = 10
DEFAULT_METRICS: tuple[str, ...] = (
    "critic/score/mean", "val/reward/mean", "actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty",
    "response_length/mean", "timing_s/step", "perf/throughput", "actor/pg_loss", "actor/entropy",
    "actor/update_rms_ratio", "critic/update_rms_ratio",
)
# Which value is "best", by the first fragment of the metric key that matches (kl before reward, so
# that actor/reward_kl_penalty counts as a KL). Metrics matching none (length, entropy) have no best, nor has a KL:
# it measures how far the policy moved (actor/ppo_kl is signed), which is no objective (its smallest value would be
# the step that learned least).
BEST_RULES: tuple[tuple[str, str | None], ...] = (
    ("kl", None), ("loss", "min"), ("timing", "min"),
    ("score", "max"), ("reward", "max"), ("throughput", "max"), ("acc", "max"),
)
# Line styles within a subplot; the color tells the run apart.
SERIES_STYLES = {
    "val/reward/mean": {"linestyle": "--", "marker": "o", "markersize": 3},
    "actor/kl_loss": {"linestyle": "--"},
    "actor/reward_kl_penalty": {"linestyle": ":"},
}
MAX_CELL = 40

History = dict[str, list[tuple[int, float]]]  # metric key -> [(step, value)] in step order


@dataclass(frozen=True)
class MetricSummary:
    """One run's metric: the value at the last step, and the best value with its step."""

    final: float
    final_step: int
    best: float | None  # None when the metric has no better direction (see BEST_RULES)
    best_step: int | None
    direction: str | None  # "max", "min" or None


@dataclass
class CompareResult:
    """What `compare_runs` found; `format_table` renders it."""

    runs: list[dict]  # run_id, name, label (unique column header), status, start_time
    differing_params: dict[str, list[str | None]]  # param -> value per run (None: not logged)
    metric_summary: dict[str, dict[str, MetricSummary | None]]  # metric -> run label -> summary
    plot_path: Path | None = None
    plotted: dict[str, list[str]] = field(default_factory=dict)  # run label -> metric keys drawn
    notes: list[str] = field(default_factory=list)


def best_direction(metric: str) -> str | None:
    """"max", "min" or None for a metric key, from BEST_RULES."""
    lowered = metric.lower()
    return next((direction for fragment, direction in BEST_RULES if fragment in lowered), None)


def compare_runs(tracking_uri: str, runs: Sequence[str] = (), experiment: str | None = None,
                 output_png: str | Path | None = None,
                 metrics: Sequence[str] = DEFAULT_METRICS) -> CompareResult:
    """Compare runs given by name or id (or the newest runs of `experiment` when none are given)."""
    _check_store_exists(tracking_uri)
    from mlflow.tracking import MlflowClient  # deferred: mlflow takes seconds to import; the parser needs none of it

    client = MlflowClient(tracking_uri=tracking_uri)
    notes: list[str] = []
    chosen = _choose_runs(client, list(runs), experiment, notes)
    labels = _unique_labels([_run_name(run) for run in chosen])
    infos = [{"run_id": run.info.run_id, "name": _run_name(run), "label": label, "status": run.info.status,
              "start_time": _format_time(run.info.start_time)} for run, label in zip(chosen, labels)]
    histories = {run.info.run_id: _histories(client, run.info.run_id, metrics) for run in chosen}
    summary: dict[str, dict[str, MetricSummary | None]] = {}
    for metric in metrics:
        row = {label: summarize(histories[run.info.run_id].get(metric, []), metric)
               for run, label in zip(chosen, labels)}
        if any(value is not None for value in row.values()):
            summary[metric] = row
    missing = [metric for metric in metrics if metric not in summary]
    if missing:
        notes.append(f"not logged by any of these runs: {', '.join(missing)}")
    result = CompareResult(infos, _differing_params(chosen), summary, notes=notes)
    if output_png is not None:
        ids = [run.info.run_id for run in chosen]
        result.plot_path = plot_runs(client, ids, labels, metrics, output_png, histories=histories)
        result.plotted = plotted_series(histories, ids, labels, metrics)
    return result


def _check_store_exists(tracking_uri: str) -> None:
    """Refuse a SQLite URI whose database file is missing (MLflow would create an empty one)."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix):
        path = tracking_uri[len(prefix):]
        if path and path != ":memory:" and not Path(path).exists():
            raise ValueError(f"no MLflow store at {path}: pass --tracking-uri of an existing store "
                             f"(training writes {DEFAULT_TRACKING_URI} by default)")


def _choose_runs(client, refs: list[str], experiment: str | None, notes: list[str]) -> list:
    """The runs named by `refs` (names or ids), or the newest MAX_RUNS of the experiment."""
    if not refs:
        name = experiment or DEFAULT_EXPERIMENT
        ids = _experiment_ids(client, name)
        found = client.search_runs(ids, order_by=["attributes.start_time DESC"], max_results=MAX_RUNS + 1)
        if not found:
            raise ValueError(f"experiment {name!r} has no runs; train one first (rlhf quickstart)")
        if len(found) > MAX_RUNS:
            notes.append(f"experiment {name!r} has more than {MAX_RUNS} runs; showing the {MAX_RUNS} newest")
        return list(found[:MAX_RUNS])
    ids = _experiment_ids(client, experiment) if experiment else [
        exp.experiment_id for exp in client.search_experiments()]
    chosen, seen = [], set()
    for ref in refs:
        run = _resolve_run(client, ref, ids, experiment, notes)
        if run.info.run_id in seen:
            notes.append(f"{ref!r} is a run already listed; shown once")
            continue
        seen.add(run.info.run_id)
        chosen.append(run)
    return chosen


def _experiment_ids(client, name: str) -> list[str]:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        known = [exp.name for exp in client.search_experiments()]
        raise ValueError(f"unknown experiment {name!r}; known experiments: {', '.join(known) or '(none)'}")
    return [experiment.experiment_id]


def _resolve_run(client, ref: str, experiment_ids: list[str], experiment: str | None, notes: list[str]):
    """A run by name (tag rlhf.run_name or mlflow.runName; the latest when several) or by id."""
    from mlflow.exceptions import MlflowException  # deferred: as compare_runs' MlflowClient

    matches = _runs_named(client, ref, experiment_ids)
    if matches:
        if len(matches) > 1:
            latest = matches[0]
            notes.append(f"name {ref!r} matches {len(matches)} runs; using the latest "
                         f"({latest.info.run_id}, started {_format_time(latest.info.start_time)})")
        return matches[0]
    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    known = client.search_runs(experiment_ids, order_by=["attributes.start_time DESC"], max_results=MAX_RUNS)
    where = f"experiment {experiment!r}" if experiment else "any experiment"
    names = ", ".join(dict.fromkeys(_run_name(run) for run in known)) or "(none)"
    raise ValueError(f"unknown run {ref!r} (no run of that name or id in {where}); known runs: {names}")


def _runs_named(client, name: str, experiment_ids: list[str]) -> list:
    """Active runs whose rlhf.run_name tag or MLflow run name is `name`, newest first."""
    if not experiment_ids:
        return []
    quote = "'" if "'" not in name else '"'
    if quote in name:
        return []  # a name with both quote kinds cannot be searched for; it may still be an id
    found = {}
    for key in ("tags.`rlhf.run_name`", "attributes.run_name"):
        for run in client.search_runs(experiment_ids, filter_string=f"{key} = {quote}{name}{quote}",
                                      order_by=["attributes.start_time DESC"], max_results=1000):
            found[run.info.run_id] = run
    return sorted(found.values(), key=lambda run: run.info.start_time or 0, reverse=True)


def _run_name(run) -> str:
    tags = run.data.tags
    return tags.get("rlhf.run_name") or run.info.run_name or tags.get("mlflow.runName") or run.info.run_id


def _unique_labels(names: list[str]) -> list[str]:
    """Run names as column headers; a repeated name gets its run's position appended."""
    counts = {name: names.count(name) for name in names}
    return [f"{name}#{index + 1}" if counts[name] > 1 else name for index, name in enumerate(names)]


def _format_time(millis: int | None) -> str | None:
    if millis is None:
        return None
    return datetime.datetime.fromtimestamp(millis / 1000).strftime("%Y-%m-%d %H:%M:%S")


def _differing_params(runs: list) -> dict[str, list[str | None]]:
    """Params whose values are not the same in every run (a missing param counts as a value)."""
    keys = sorted(set().union(*(run.data.params for run in runs))) if runs else []
    differing = {}
    for key in keys:
        values = [run.data.params.get(key) for run in runs]
        if len(set(values)) > 1:
            differing[key] = values
    return differing


def _histories(client, run_id: str, metrics: Sequence[str]) -> History:
    """Each logged metric's (step, value) points, by step (then logging time), finite values only."""
    histories: History = {}
    for metric in metrics:
        points = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
        series = [(int(m.step), float(m.value)) for m in points if math.isfinite(m.value)]
        if series:
            histories[metric] = series
    return histories


def summarize(points: list[tuple[int, float]], metric: str) -> MetricSummary | None:
    """Final value (last step) and best value with its step (the earliest step on ties)."""
    if not points:
        return None
    final_step, final = points[-1]
    direction = best_direction(metric)
    if direction is None:
        return MetricSummary(final, final_step, None, None, None)
    pick = max if direction == "max" else min
    best_step, best = pick(points, key=lambda point: point[1])  # first of equal values
    return MetricSummary(final, final_step, best, best_step, direction)


def plot_group(metric: str) -> str | None:
    """The subplot a metric goes in: reward, KL, response length, update size, its own (a metric asked for
    beyond the defaults), or None (default metrics shown in the table only)."""
    if "kl" in metric.lower():
        return "KL"
    if "response_length" in metric:
        return "response length"
    if "score" in metric or "reward" in metric:
        return "reward"
    if metric.endswith("/update_rms_ratio"):  # a run whose updates vanish is flat at 0 here
        return "update size (RMS of the change / RMS of the weights)"
    return None if metric in DEFAULT_METRICS else metric


def plotted_series(histories: dict[str, History], run_ids: Sequence[str], names: Sequence[str],
                   metrics: Sequence[str]) -> dict[str, list[str]]:
    """Run name -> the metric keys `plot_runs` draws for it (those with a group and data)."""
    return {name: [metric for metric in metrics if plot_group(metric) and metric in histories[run_id]]
            for run_id, name in zip(run_ids, names)}


def plot_runs(client, run_ids: Sequence[str], names: Sequence[str], metrics: Sequence[str],
              output_png: str | Path, histories: dict[str, History] | None = None) -> Path:
    """Write a PNG, one subplot per series group, x = step, one color per run; return its path."""
    # deferred: matplotlib takes a second to import, and only a plot needs it
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.use("Agg")

    if histories is None:
        histories = {run_id: _histories(client, run_id, metrics) for run_id in run_ids}
    series = plotted_series(histories, run_ids, names, metrics)
    groups = list(dict.fromkeys(plot_group(m) for m in metrics if any(m in keys for keys in series.values())))
    figure = Figure(figsize=(5.5 * max(len(groups), 1), 4.2), layout="constrained")
    axes = figure.subplots(1, max(len(groups), 1), squeeze=False)[0]
    if not groups:
        axes[0].text(0.5, 0.5, "none of the plotted metrics were logged", ha="center", va="center")
    colors = matplotlib.colormaps["tab10"]
    for ax, group in zip(axes, groups):
        for index, (run_id, name) in enumerate(zip(run_ids, names)):
            for metric in (m for m in series[name] if plot_group(m) == group):
                steps, values = zip(*histories[run_id][metric])
                ax.plot(steps, values, color=colors(index % 10), label=f"{name}: {metric}",
                        **SERIES_STYLES.get(metric, {"linestyle": "-"}))
        ax.set_title(group)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    path = Path(output_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def _number(value: float) -> str:
    return f"{value:.4g}"


def _metric_cell(summary: MetricSummary | None) -> str:
    if summary is None:
        return "-"
    if summary.best is None:
        return _number(summary.final)
    return f"{_number(summary.final)} / {_number(summary.best)}@{summary.best_step}"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def _render(corner: str, labels: list[str], rows: list[list[str]], width: int) -> list[str]:
    """Aligned columns; run columns that do not fit in `width` continue in a block below."""
    table = [[_clip(cell) for cell in row] for row in [[corner, *labels], *rows]]
    widths = [max(len(row[col]) for row in table) for col in range(len(table[0]))]
    blocks, current, used = [], [], widths[0]
    for col in range(1, len(widths)):
        if current and used + 2 + widths[col] > width:
            blocks.append(current)
            current, used = [], widths[0]
        current.append(col)
        used += 2 + widths[col]
    blocks.append(current)
    lines: list[str] = []
    for block in blocks:
        if lines:
            lines.append("")
        for number, row in enumerate(table):
            cells = [row[0].ljust(widths[0])] + [row[col].rjust(widths[col]) for col in block]
            lines.append("  ".join(cells).rstrip())
            if number == 0:
                lines.append("-" * len(lines[-1]))
    return lines


def format_table(result: CompareResult, width: int | None = None) -> str:
    """Plain-text tables: the differing params, then each metric as "final / best@step" per run."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    labels = [run["label"] for run in result.runs]
    lines: list[str] = []
    if result.differing_params:
        rows = [[key, *("-" if value is None else value for value in values)]
                for key, values in result.differing_params.items()]
        lines += _render("param", labels, rows, width)
    else:
        lines.append("params: the same in every run" if len(labels) > 1 else "params: one run, nothing to compare")
    lines += ["", "metrics: final / best@step (best: max for score/reward/throughput, min for loss/timing; none for "
                  "KL, which is no objective)"]
    rows = [[metric, *(_metric_cell(per_run.get(label)) for label in labels)]
            for metric, per_run in result.metric_summary.items()]
    lines += _render("metric", labels, rows, width) if rows else ["(no metrics logged)"]
    return "\n".join(lines)


def cmd_compare(args) -> int:
    """Print the comparison table, any notes and the plot's path."""
    from flows.runtime.tracking import tracking_uri  # deferred: imports mlflow (seconds), for this command only

    uri = tracking_uri(build_config({"tracking": {"tracking_uri": getattr(args, "tracking_uri", None)
                                                  or DEFAULT_TRACKING_URI}}))
    result = compare_runs(uri, getattr(args, "runs", None) or (), getattr(args, "experiment", None),
                          getattr(args, "output", None) or DEFAULT_OUTPUT,
                          getattr(args, "metric", None) or DEFAULT_METRICS)
    for run in result.runs:
        print(f"{run['label']}: {run['run_id']} {run['status']} started {run['start_time']}")
    print()
    print(format_table(result))
    for note in result.notes:
        print(f"note: {note}")
    print(f"plot: {result.plot_path}")
    return 0


def add_compare_parser(subcommands):
    """Add the `compare` subcommand to an argparse subparsers object; return its parser."""
    parser = subcommands.add_parser(
        "compare", help="compare runs recorded in MLflow: differing params, metrics, a plot",
        description="Compare training runs: the params that differ, each metric's final and best value, "
                    "and a PNG of reward, KL, response length and update size by step.\n\nexamples:\n"
                    "  rlhf compare                       # the 10 newest runs of experiment rlhf\n"
                    "  rlhf compare exp1 exp2 --output .rlhf/compare.png\n"
                    "  rlhf compare exp1 exp2 --metric critic/score/mean --metric actor/entropy",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="run names or run ids (default: the newest runs)")
    parser.add_argument("--experiment", default=None,
                        help=f"MLflow experiment to look in (default: all for named runs, "
                             f"{DEFAULT_EXPERIMENT!r} when no run is named)")
    parser.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI,
                        help=f"MLflow tracking URI (default: {DEFAULT_TRACKING_URI})")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help=f"PNG to write (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--metric", action="append", default=None,
                        help="a metric to compare, repeatable (default: reward, KL, length, timing, losses)")
    parser.set_defaults(handler=cmd_compare)
    return parser
