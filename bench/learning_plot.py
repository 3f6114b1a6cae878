"""Draw validation-reward learning curves of one or more runs, and print a markdown table comparing them.

Each input is a result JSON with a "curve" list of {"step", "train_wall_s", "val_reward"} points (bench/trl_learning.py
writes one with "trainer": "trl"; the product's has "trainer": "rlhf-flow"). The PNG has two panels: validation reward
against optimizer steps, and against training wall-clock seconds (validation and start-up excluded); one line per
file, labelled by its trainer (with the file's name when two files share a trainer).

The table, one row per file: steps (the last curve point's step), start reward (the first point's), final reward
(the last point's), best, wall s (the last point's train_wall_s), s/step (wall s / steps), and the training seconds
it took to reach each other run's final reward (the first point at or above it; "not reached" when none is).

    python bench/learning_plot.py bench/results/product-learning.json bench/results/trl-learning.json \\
        --out bench/results/learning.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def load_run(path: str) -> dict:
    """{"label", "trainer", "path", "curve"} of one result file; the curve sorted by step."""
    data = json.loads(Path(path).read_text())
    curve = data.get("curve")
    if not curve:
        raise SystemExit(f"{path}: no 'curve' points")
    for point in curve:
        missing = [key for key in ("step", "train_wall_s", "val_reward") if point.get(key) is None]
        if missing:
            raise SystemExit(f"{path}: a curve point lacks {missing}: {point}")
    curve = sorted(curve, key=lambda point: (point["step"], point["train_wall_s"]))
    trainer = str(data.get("trainer") or Path(path).stem)
    return {"label": trainer, "trainer": trainer, "path": path, "curve": curve, "partial": bool(data.get("partial"))}


def label_runs(runs: list[dict]) -> None:
    """Labels by trainer; runs sharing a trainer get their file's name added."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run["trainer"]] = counts.get(run["trainer"], 0) + 1
    for run in runs:
        if counts[run["trainer"]] > 1:
            run["label"] = f"{run['trainer']} ({Path(run['path']).stem})"
        if run["partial"]:
            run["label"] += " [partial]"


def seconds_to_reach(curve: list[dict], reward: float) -> float | None:
    """train_wall_s of the first point whose val_reward is at least `reward`; None when no point is."""
    for point in curve:
        if point["val_reward"] >= reward - 1e-12:
            return float(point["train_wall_s"])
    return None


def summary_rows(runs: list[dict]) -> tuple[list[dict], list[str]]:
    """The table's rows and columns (see the module docstring)."""
    rows, reach_columns = [], []
    finals = {run["label"]: run["curve"][-1]["val_reward"] for run in runs}
    for run in runs:
        curve = run["curve"]
        steps = curve[-1]["step"]
        wall = float(curve[-1]["train_wall_s"])
        row = {"trainer": run["label"], "steps": steps, "start reward": curve[0]["val_reward"],
               "final reward": curve[-1]["val_reward"], "best": max(point["val_reward"] for point in curve),
               "wall s": wall, "s/step": wall / steps if steps else None}
        for other in runs:
            if other is run:
                continue
            column = ("s to reach the other's final" if len(runs) == 2
                      else f"s to reach {other['label']}'s final")
            if column not in reach_columns:
                reach_columns.append(column)
            seconds = seconds_to_reach(curve, finals[other["label"]])
            target = f"{finals[other['label']]:.4g}"
            row[column] = f"{seconds:.1f} (≥ {target})" if seconds is not None else f"not reached ({target})"
        rows.append(row)
    columns = ["trainer", "steps", "start reward", "final reward", "best", "wall s", "s/step", *reach_columns]
    return rows, columns


def plot(runs: list[dict], out: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        steps = [point["step"] for point in run["curve"]]
        walls = [point["train_wall_s"] for point in run["curve"]]
        rewards = [point["val_reward"] for point in run["curve"]]
        by_step.plot(steps, rewards, marker="o", markersize=3, label=run["label"])
        by_time.plot(walls, rewards, marker="o", markersize=3, label=run["label"])
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("training wall-clock s (validation excluded)")
    for axis in (by_step, by_time):
        axis.set_ylabel("validation reward")
        axis.grid(alpha=0.3)
        axis.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="result JSON files with a 'curve'")
    parser.add_argument("--out", default="learning.png", help="the PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)

    from common import markdown_table

    runs = [load_run(path) for path in args.files]
    label_runs(runs)
    plot(runs, args.out, args.title)
    rows, columns = summary_rows(runs)
    print(markdown_table(rows, columns))
    print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
