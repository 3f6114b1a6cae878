"""What the terminal shows of a run: what a person watches, while Prefect and MLflow keep every log.

Prefect's console handler prints every task run's lifecycle (`Created task run`, `Finished in state
Completed()`), several lines per stage; transformers draws a progress bar each time it writes or loads a
model; MLflow reports at INFO that it created its tables or started its system metrics. `quiet_console()` keeps
those off the terminal only: Prefect's records still reach its API handler (the UI shows them) because the
filter sits on the console handlers, not on the loggers. What stays: the flow's own lines (one per step, the
run's start and end), every warning and error except the engine's report of a run failed by a user error (a
ValueError, OSError or FloatingPointError: the CLI prints it as one line, Prefect keeps its traceback) and its
reports of stages and the flow cut short by a stop (the CLI's stop line says it), and the progress lines of
long work (`progress(...)`, `long_work(...)`: model loads and the engine start, the warm-start, validation,
checkpoints, the export), the workers' ones relayed by the driver (`show`), and the run's warnings about itself
(`warn(...)`: a run with no learning signal).

In every process that imports the flow (a deployment's flow-run process too, whose output is the Prefect worker's
log), a flow run that a user error ended is one line on the console: Prefect's engine repeats such an error three
times with its traceback, and only its `Finished in state Failed(...)` line is kept (`FlowErrorsInOneLine`;
RLHF_DEBUG=1 shows them all).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import threading
import time
from typing import Iterator

from prefect import get_run_logger
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import PrefectConsoleHandler
from transformers.utils import logging as transformers_logging

from flows.runtime.supervision import STOPPING

PROGRESS_LOGGER = "rlhf.progress"

_ENGINE_LINES = re.compile(
    r"^(Created task run|Submitting task run|Submitted task run|Executing '|Finished in state|Beginning flow run|"
    r"View at |Running hook|Hook .* finished running|Opening process|Completed submission of flow run|"
    r"Downloading flow code|Running \d+ deployment pull step|Executing deployment step)")


USER_ERRORS = (ValueError, OSError, FloatingPointError)
"""What a stage raises for the user to fix (bad data, a reward function that raised, a path, NaN in a step):
`rlhf` prints it as its one `error:` line, so the terminal shows no traceback of it (Prefect's log keeps it)."""


def _reported_by_the_cli(record: logging.LogRecord) -> bool:
    """Prefect's engine reporting a task or flow run that failed: with a user error (the traceback), the final
    `Finished in state Failed(...)` line, which repeats the error the CLI prints, or any failure or crash while
    the process stops (a stage interrupted by the stop, the flow's `Crash detected!`): the CLI's stop line says it."""
    if record.levelno != logging.ERROR or not record.name.startswith(("prefect.task_runs", "prefect.flow_runs")):
        return False
    if STOPPING.is_set() or (record.exc_info and isinstance(record.exc_info[1], USER_ERRORS)):
        return True
    return record.getMessage().startswith("Finished in state Failed(")


class ConsoleFilter(logging.Filter):
    """Drops Prefect's per-task lifecycle lines (INFO and below) from a console handler, its reports of a run failed
    by a user error (the CLI's one line says it), and vLLM's warnings about the build (the CPU build's Triton note)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "rlhf_progress", False):  # progress() printed it already
            return False
        if record.name.startswith("vllm") and record.levelno < logging.ERROR:  # logged before VLLM_LOGGING_LEVEL applies
            return False
        if record.levelno >= logging.WARNING:
            return not _reported_by_the_cli(record)
        if record.name.startswith("prefect.task_runs"):
            return False
        if record.name.startswith(("prefect.flow_run", "prefect.workers", "prefect.tasks")):  # .tasks: `.delay()`
            return not _ENGINE_LINES.match(record.getMessage())
        return True


def debugging() -> bool:
    """RLHF_DEBUG set (not 0): tracebacks are shown, as `rlhf --debug` shows them."""
    return os.environ.get("RLHF_DEBUG", "") not in ("", "0")


class FlowErrorsInOneLine(logging.Filter):
    """Prefect's engine reports a flow run that a user error ended (USER_ERRORS: a run refused by its lock, a config,
    model or data that do not check out, a stage's error that ended the run) three times, each with the traceback:
    `Encountered exception during execution`, `Engine execution exited with unexpected exception` and `Execution of
    flow run ... exited with unexpected exception`. On a console handler they are dropped (not with RLHF_DEBUG=1):
    the flow run's `Finished in state Failed("...")` line says the error in one line. Prefect's API log keeps them
    (the filter sits on the console handler), and a stage's own report of its error (prefect.task_runs) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info or not record.name.startswith(
                ("prefect.flow_runs", "prefect.engine")):
            return True
        return not isinstance(record.exc_info[1], USER_ERRORS) or debugging()


def one_line_flow_errors() -> None:
    """Put FlowErrorsInOneLine on Prefect's console handlers (once)."""
    for handler in _console_handlers():
        if not any(isinstance(existing, FlowErrorsInOneLine) for existing in handler.filters):
            handler.addFilter(FlowErrorsInOneLine())


class WarningsOnly(logging.Filter):
    """On MLflow's console handler: its INFO lines (tables created, system metrics started) are not for the
    terminal of a run; its warnings and errors are."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def _console_handlers() -> list[logging.Handler]:
    handlers = []
    for logger in [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler) and handler not in handlers:
                handlers.append(handler)
    return handlers


def quiet_console() -> None:
    """Filter Prefect's console handlers (once) and turn transformers' progress bars off in this process;
    progress lines (`progress`) go to the terminal."""
    for handler in _console_handlers():
        if not any(isinstance(existing, ConsoleFilter) for existing in handler.filters):
            handler.addFilter(ConsoleFilter())
    # vLLM's own notes (the CPU build's Triton and LD_PRELOAD hints, its engine processes' start) in this process and
    # the engine processes it starts; VLLM_LOGGING_LEVEL=WARNING or INFO set by the user shows them again.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for handler in logging.getLogger("mlflow").handlers:  # MLflow's own only (a test's capture handler may be there)
        if type(handler.formatter).__name__ == "MlflowFormatter" and \
                not any(isinstance(existing, WarningsOnly) for existing in handler.filters):
            handler.addFilter(WarningsOnly())
    transformers_logging.disable_progress_bar()
    logger = logging.getLogger(PROGRESS_LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s | %(message)s", datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def progress(message: str) -> None:
    """One line about long work under way ("warm-start step 40/100, loss 1.23"): on the terminal of a
    process that called quiet_console (the CLI's run, a worker's log), and in Prefect's logs of the stage
    running it."""
    logging.getLogger(PROGRESS_LOGGER).info(message)
    try:
        get_run_logger().info(message, extra={"rlhf_progress": True})
    except MissingContextError:  # outside a flow or task run: the terminal line is all
        pass


def warn(line: str) -> None:
    """A warning for the person watching the run ("warning: no learning signal ..."): once on the terminal, and
    at WARNING in Prefect's log of the flow or stage running it. In a process that called quiet_console the
    progress handler prints it (the Prefect record is marked printed); elsewhere (a deployment's flow run,
    the Python API) Prefect's console handler does."""
    terminal = logging.getLogger(PROGRESS_LOGGER)
    try:
        run_logger = get_run_logger()
    except MissingContextError:  # outside a flow or task run: the terminal line is all
        terminal.warning(line)
        return
    printed = bool(terminal.handlers)
    if printed:
        terminal.warning(line)
    run_logger.warning(line, extra={"rlhf_progress": printed})


def show(line: str) -> None:
    """A line on this process's terminal only, as progress lines are printed: a worker's progress line that the
    driver relays (flows.runtime.dispatch.ProgressRelay; Prefect has it already, in the stage's task run log)."""
    logging.getLogger(PROGRESS_LOGGER).info(line)


class Work:
    """What long_work prints at the end (`done`, a format of {seconds}); the caller may change it as it learns
    the result."""

    def __init__(self, done: str):
        self.done = done


@contextlib.contextmanager
def long_work(start: str, still: str, done: str, every_s: float = 20.0, announce_after_s: float = 0.0) -> Iterator[Work]:
    """Progress lines around work that may take long: `start` as it begins, `still` every `every_s` seconds while
    it runs, `done` when it ends (not when it raises: the error says it); `still` and `done` are formats of
    {seconds}. With announce_after_s > 0, work that ends sooner prints nothing, and `start` comes (with the
    seconds so far) only once it has run that long. The lines come from a timer thread, which sees the caller's
    Prefect run context, so they reach the stage's log too."""
    work, stop, started = Work(done), threading.Event(), time.perf_counter()
    announced = announce_after_s <= 0
    if announced:
        progress(start)

    def watch() -> None:
        nonlocal announced
        due = every_s if announced else announce_after_s
        while not stop.wait(max(0.0, due - (time.perf_counter() - started))):
            seconds = time.perf_counter() - started
            progress(still.format(seconds=seconds) if announced else f"{start} ({seconds:.0f} s so far)")
            announced, due = True, due + every_s

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(watch,), name="rlhf-long-work", daemon=True)
    thread.start()
    try:
        yield work
    finally:
        stop.set()
        thread.join()
    if announced:
        progress(work.done.format(seconds=time.perf_counter() - started))


# At import: a deployment's flow-run process runs no code of this project before the flow's module is imported
# (which imports this one), and Prefect has set up its console handler by then (`import prefect` does).
one_line_flow_errors()
