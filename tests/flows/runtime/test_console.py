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
    # A stage submitted to a worker (`.delay()`): one per stage and step under trainer.execution=workers.
    assert not keep(_record("prefect.tasks", "Created task run 'reward-3'. View it in the UI at 'http://x/runs/1'"))
    assert not keep(_record("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend.",
                            logging.WARNING))
    assert keep(_record("vllm.engine", "the engine died", logging.ERROR))
    # The flow's own lines and everything at WARNING or above stay.
    assert keep(_record("prefect.flow_runs", "step 3/20 | score 0.125 | val 0.250"))
    assert keep(_record("prefect.flow_runs", "validation before RL: reward 0.000"))
    assert keep(_record("prefect.task_runs", "Task run failed with exception: ValueError", logging.ERROR))
    assert keep(_record("prefect.task_runs", "Retry 1/2", logging.WARNING))
    assert keep(_record("rlhf.progress", "starting the vLLM rollout engine ..."))



def _raised(error: BaseException):
    try:
        raise error
    except BaseException:
        import sys

        return sys.exc_info()


def test_a_flow_run_a_user_error_ended_is_one_line_on_the_console(monkeypatch):
    """Issue 41, item 4: a deployment's run refused by the run lock had one line as its state message, and the
    worker's log (its flow-run process's console) added the engine's reports of it with their tracebacks. The filter
    sits on Prefect's console handler from the import of this module on; RLHF_DEBUG=1 keeps the tracebacks."""
    from flows.runtime.supervision import RunLockedError

    monkeypatch.delenv("RLHF_DEBUG", raising=False)
    refused = _raised(RunLockedError("run.name='nightly' is live: pid 7 on head holds it (x.lock); wait for it to end, "
                                     "stop it, or choose another run.name"))
    reports = [_record("prefect.flow_runs", "Encountered exception during execution: %r", logging.ERROR,
                       exc_info=refused),
               _record("prefect.flow_runs", "Engine execution exited with unexpected exception", logging.ERROR,
                       exc_info=refused),
               _record("prefect.engine", "Execution of flow run '1' exited with unexpected exception", logging.ERROR,
                       exc_info=refused)]
    finished = _record("prefect.flow_runs", "Finished in state Failed(\"Flow run encountered an exception: "
                       "RunLockedError: run.name='nightly' is live: ...\")")
    keep = console.FlowErrorsInOneLine().filter
    assert [keep(record) for record in reports] == [False, False, False]
    assert keep(finished)
    # Not a user error, or a stage's own report of its error: the traceback stays.
    crashed = _raised(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert keep(_record("prefect.flow_runs", "Encountered exception during execution: %r", logging.ERROR,
                        exc_info=crashed))
    assert keep(_record("prefect.task_runs", "Task run failed with exception: %r", logging.ERROR, exc_info=refused))
    monkeypatch.setenv("RLHF_DEBUG", "1")
    assert [keep(record) for record in reports] == [True, True, True]
    monkeypatch.setenv("RLHF_DEBUG", "0")
    assert not keep(reports[0])
    # Installed on Prefect's console handler by the import (the flow-run process imports nothing else of ours first).
    from prefect.logging.handlers import PrefectConsoleHandler

    handlers = [handler for handler in logging.getLogger().handlers if isinstance(handler, PrefectConsoleHandler)]
    assert handlers and all(any(isinstance(f, console.FlowErrorsInOneLine) for f in handler.filters)
                            for handler in handlers)


def test_while_the_process_stops_prefects_reports_of_cut_short_runs_leave_the_terminal():
    """A stop (SIGTERM, Ctrl-C) ends the stages running beside the flow and the flow itself: Prefect reports each as
    failed or crashed, which the CLI's one line (`SIGTERM: stopped; the run is resumable: ...`) says; other lines
    stay."""
    from flows.runtime.supervision import STOPPING

    keep = console.ConsoleFilter().filter
    failed = _record("prefect.task_runs", "Task run failed with exception: AttributeError(\"'NoneType' object has no "
                     "attribute 'sleep'\")", logging.ERROR)
    crash = "Crash detected! Execution was aborted by an interrupt signal."
    crashed, stage_crashed = (_record(name, crash, logging.ERROR) for name in ("prefect.flow_runs",
                                                                              "prefect.task_runs"))
    assert keep(failed) and keep(crashed) and keep(stage_crashed)  # without a stop: a failure to read
    STOPPING.set()
    try:
        assert not keep(failed) and not keep(crashed) and not keep(stage_crashed)
        assert keep(_record("prefect.flow_runs", "the checkpoint being written could not be committed",
                            logging.WARNING))
        assert keep(_record("vllm.engine", "the engine died", logging.ERROR))
        assert keep(_record("rlhf.progress", "checkpoint at step 4: the run, stopping, waits for the actor to write"))
    finally:
        STOPPING.clear()

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


def test_mlflow_info_lines_leave_the_terminal_and_its_warnings_stay(monkeypatch):
    from mlflow.utils.logging_utils import MlflowFormatter

    stream, other = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(stream)  # MLflow's own handler on its logger, as MLflow configures it
    handler.setFormatter(MlflowFormatter(fmt="%(message)s"))
    capture = logging.StreamHandler(other)  # someone else's handler there (pytest's capture): left alone
    mlflow_logger = logging.getLogger("mlflow")
    monkeypatch.setattr(mlflow_logger, "handlers", [handler, capture])
    console.quiet_console()
    logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
    logging.getLogger("mlflow.system_metrics.system_metrics_monitor").info("Started monitoring system metrics.")
    logging.getLogger("mlflow.tracking").warning("the tracking server is slow")
    assert stream.getvalue() == "the tracking server is slow\n"
    assert other.getvalue().splitlines() == ["Creating initial MLflow database tables...",
                                             "Started monitoring system metrics.", "the tracking server is slow"]


def test_long_work_says_what_it_does_while_it_lasts_and_quick_work_stays_silent(monkeypatch):
    import re
    import time

    lines: list[str] = []
    monkeypatch.setattr(console, "progress", lines.append)
    with console.long_work("starting the engine ...", "starting the engine: {seconds:.1f} s so far",
                           "engine ready in {seconds:.1f} s", every_s=0.2):
        time.sleep(0.7)
    assert lines[0] == "starting the engine ..."
    assert 2 <= len(lines[1:-1]) <= 3 and all(re.fullmatch(r"starting the engine: 0\.[2-7] s so far", line)
                                              for line in lines[1:-1]), lines
    assert re.fullmatch(r"engine ready in 0\.[7-9] s", lines[-1]), lines
    lines.clear()
    with console.long_work("validation: 200 prompts", "{seconds}", "done", every_s=0.2, announce_after_s=1.0):
        time.sleep(0.1)
    assert lines == []  # ended before announce_after_s: nothing to say
    with console.long_work("checkpoint at step 3", "checkpoint: {seconds:.1f} s so far", "", every_s=10,
                           announce_after_s=0.2) as work:
        time.sleep(0.5)
        work.done = "checkpoint at step 3: written in {seconds:.1f} s"
    assert len(lines) == 2 and re.fullmatch(r"checkpoint at step 3 \(0 s so far\)", lines[0]), lines
    assert re.fullmatch(r"checkpoint at step 3: written in 0\.[5-9] s", lines[1]), lines
    lines.clear()
    try:
        with console.long_work("export ...", "export: {seconds} s", "exported in {seconds:.1f} s"):
            raise OSError("disk full")
    except OSError:
        pass
    assert lines == ["export ..."]  # no `done` line for work that raised: the error says it


def test_a_warning_reaches_the_terminal_once_and_prefect_at_warning(monkeypatch):
    lines, logged = [], []

    class Terminal(logging.Handler):
        def emit(self, record):
            lines.append((record.levelno, record.getMessage()))

    class RunLogger:  # the flow run's logger: Prefect's API handler, and its console handler unless marked printed
        def warning(self, message, extra):
            logged.append((message, extra))

    progress_logger = logging.getLogger(console.PROGRESS_LOGGER)
    monkeypatch.setattr(console, "get_run_logger", RunLogger)
    monkeypatch.setattr(progress_logger, "handlers", [Terminal()])  # as quiet_console leaves it (`rlhf train`)
    console.warn("warning: no learning signal for 5 steps")
    assert lines == [(logging.WARNING, "warning: no learning signal for 5 steps")]
    assert logged == [("warning: no learning signal for 5 steps", {"rlhf_progress": True})]
    assert not console.ConsoleFilter().filter(_record("prefect.flow_runs", "w", logging.WARNING, rlhf_progress=True))
    # No quiet_console (a deployment's run, the Python API): Prefect's console handler prints it, nothing else.
    monkeypatch.setattr(progress_logger, "handlers", [])
    lines.clear()
    console.warn("warning: again")
    assert lines == [] and logged[-1] == ("warning: again", {"rlhf_progress": False})
    assert console.ConsoleFilter().filter(_record("prefect.flow_runs", "w", logging.WARNING, rlhf_progress=False))
