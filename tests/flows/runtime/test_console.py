"""flows.runtime.console: Prefect's per-task lifecycle lines leave the terminal (not Prefect's own log
handlers), the flow's lines, warnings and progress lines stay."""

from __future__ import annotations

import io
import logging

from flows.runtime import console


def _record(name: str, message: str, level: int = logging.INFO, **extra) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, message, (), None)
    record.__dict__.update(extra)
    return record


def test_the_filter_drops_task_lifecycle_and_engine_lines_and_keeps_the_rest():
    keep = console.ConsoleFilter().filter
    assert not keep(_record("prefect.task_runs", "Finished in state Completed()"))
    assert not keep(_record("prefect.task_runs", "anything a task prints at INFO"))
    assert not keep(_record("prefect.flow_runs", "Created task run 'rollout-3' for task 'rollout'"))
    assert not keep(_record("prefect.flow_runs", "Finished in state Completed()"))
    assert not keep(_record("prefect.flow_runs", "Beginning flow run 'quickstart' for flow 'rlhf-train'"))
    assert not keep(_record("prefect.flow_runs", "warm-start step 4/10", rlhf_progress=True))  # printed already
    # The flow's own lines and everything at WARNING or above stay.
    assert keep(_record("prefect.flow_runs", "step 3/20 | score 0.125 | val 0.250"))
    assert keep(_record("prefect.flow_runs", "validation before RL: reward 0.000"))
    assert keep(_record("prefect.task_runs", "Task run failed with exception: ValueError", logging.ERROR))
    assert keep(_record("prefect.task_runs", "Retry 1/2", logging.WARNING))
    assert keep(_record("rlhf.progress", "starting the vLLM rollout engine ..."))


def test_quiet_console_filters_console_handlers_only_and_progress_reaches_the_terminal(monkeypatch):
    from prefect.logging.handlers import PrefectConsoleHandler

    stream = io.StringIO()
    terminal = PrefectConsoleHandler(stream=stream)
    kept: list[str] = []

    class Keeper(logging.Handler):  # stands for Prefect's API handler: it must still get every record
        def emit(self, record):
            kept.append(record.getMessage())

    logger = logging.getLogger("prefect.task_runs.test-console")
    api = Keeper()
    monkeypatch.setattr(logging.getLogger(), "handlers", logging.getLogger().handlers + [terminal])
    logger.addHandler(api)
    try:
        console.quiet_console()
        console.quiet_console()  # twice: one filter
        assert sum(isinstance(f, console.ConsoleFilter) for f in terminal.filters) == 1
        logger.warning("Retry 1/2")
        logger.error("it raised")
        logger.info("Finished in state Completed()")
        assert kept == ["Retry 1/2", "it raised", "Finished in state Completed()"]
        printed = stream.getvalue()
        assert "Retry 1/2" in printed and "it raised" in printed and "Finished in state" not in printed
        progress_stream = io.StringIO()
        monkeypatch.setattr(logging.getLogger(console.PROGRESS_LOGGER).handlers[0], "stream", progress_stream)
        console.progress("warm-start step 3/10: loss 1.2000 (4 s)")
        assert progress_stream.getvalue().rstrip().endswith("| warm-start step 3/10: loss 1.2000 (4 s)")
    finally:
        logger.removeHandler(api)
        terminal.filters.clear()
