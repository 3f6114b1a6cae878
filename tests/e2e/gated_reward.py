"""A test-only reward function (`reward.function=gated_reward:exact_match_once_open`): exact match, once the file
named by GATED_REWARD_GATE exists (it waits for it, up to 30 minutes), so that a test holds a run live while it
checks what happens beside it."""

import os
import time
from pathlib import Path

from components.rewards import exact_match


def exact_match_once_open(response_text, ground_truth, data_source="", extra_info=None):
    gate, deadline = Path(os.environ["GATED_REWARD_GATE"]), time.monotonic() + 1800
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return exact_match(response_text, ground_truth, data_source, extra_info)
