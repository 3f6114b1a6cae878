"""A test-only Prefect task served by a task worker (tests/e2e/test_worker_subscription.py)."""

from prefect import task


@task(persist_result=True)
def double(x: int) -> int:
    return 2 * x
