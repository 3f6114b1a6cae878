"""A test-only Prefect task served by a task worker (tests/e2e/test_worker_subscription.py): it leaves its answer
in a file, so that the test needs no Prefect client of its own to see that it ran."""

from pathlib import Path

from prefect import task


@task(persist_result=True)
def double(x: int, answer: str) -> int:
    Path(answer).write_text(str(2 * x))
    return 2 * x
