"""A test-only reward function (`reward.function=killing_reward:die`): SIGKILLs the process that calls it, every
time, as a machine that loses power at the same point of every attempt would."""

import os
import signal


def die(response_text, ground_truth, data_source="", extra_info=None):
    os.kill(os.getpid(), signal.SIGKILL)
