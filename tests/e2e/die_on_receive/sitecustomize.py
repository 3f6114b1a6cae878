"""Test fault injection, imported at start by every Python process with this folder on PYTHONPATH.

The worker of the role named in RLHF_TEST_DIE_ON_RECEIVE kills itself the moment Prefect hands it its
first task run: the server has the run acknowledged, and nothing about it (no Running state, no
heartbeat entry) ever leaves the worker. A marker file in the heartbeat folder makes it happen once,
so the replacement worker runs normally.
"""

import os
import sys

_role = os.environ.get("RLHF_TEST_DIE_ON_RECEIVE")
_argv = list(getattr(sys, "orig_argv", []))
if _role and "worker" in _argv and "--role" in _argv and _argv[_argv.index("--role") + 1] == _role:
    import signal

    import prefect.task_worker

    _marker = os.path.join(os.environ["RLHF_WORKER_DIR"], f"died-on-receive-{_role}")
    _submit = prefect.task_worker.TaskWorker._safe_submit_scheduled_task_run

    async def _die_on_first_run(self, task_run):
        try:
            open(_marker, "x").close()
        except FileExistsError:
            return await _submit(self, task_run)
        os.kill(os.getpid(), signal.SIGKILL)

    prefect.task_worker.TaskWorker._safe_submit_scheduled_task_run = _die_on_first_run
