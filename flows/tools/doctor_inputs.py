"""What `rlhf train` checks before it creates anything, for `rlhf doctor CONFIG` (flows/tools/doctor.py).

The same checks as the run's preflight (flows/training/preflight.py), on this machine: trainer.device, then the
rest (model folders, data files and globs, model.from_run, the reward function, where the run writes), each
failing one the same line `rlhf train` would print. No model loads (the tokenizer does).
"""

from __future__ import annotations

from flows.training.preflight import check_device, check_inputs


def _line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def inputs_report(config) -> dict:
    """{"status": "ok" or "fail", "errors": the lines a run would refuse with, "lines": what it would report at its
    start (prompt counts, scorers) when nothing fails}. trainer.device is checked on its own, so that a config with a
    device this machine lacks and a missing model folder shows both."""
    errors = []
    try:
        check_device(config)
    except ValueError as error:
        errors.append(_line(error))
    try:
        summary = check_inputs(config, devices=False)
    except (ValueError, OSError) as error:
        errors.append(_line(error))
        summary = None
    if errors:
        return {"status": "fail", "detail": f"{len(errors)} error(s): the run would be refused", "errors": errors,
                "lines": []}
    return {"status": "ok", "detail": "model, data, reward and where the run writes check out", "errors": [],
            "lines": summary.lines()}


def format_inputs(inputs: dict, markers: dict[str, str]) -> list[str]:
    """The report's `Run inputs` section: a FAIL line per error, or the ok line and what the run would report."""
    lines = ["Run inputs"]
    if inputs["errors"]:
        return lines + [f"  {markers['fail']}  {error}" for error in inputs["errors"]]
    return lines + [f"  {markers['ok']}  {inputs['detail']}"] + [f"        {line}" for line in inputs["lines"]]
