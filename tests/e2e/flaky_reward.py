"""A test-only reward function (`reward.function=flaky_reward:exact_match_failing_once`): exact match, but the
first call raises while the file named by FLAKY_REWARD_MARKER does not exist (the call creates it), as a
reward service that times out once would."""

import os
from pathlib import Path

from components.rewards import exact_match


def exact_match_failing_once(response_text, ground_truth, data_source="", extra_info=None):
    marker = Path(os.environ["FLAKY_REWARD_MARKER"])
    if not marker.exists():
        marker.touch()
        raise ConnectionError("the reward service did not answer (once)")
    return exact_match(response_text, ground_truth, data_source, extra_info)
