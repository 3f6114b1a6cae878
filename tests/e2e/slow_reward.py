"""A test-only reward function (`reward.function=slow_reward:exact_match_slowly`): exact match, slowly,
so that a test can kill the reward worker while its stage is running."""

import time

from components.rewards import exact_match


def exact_match_slowly(response_text, ground_truth, data_source="", extra_info=None):
    time.sleep(0.1)
    return exact_match(response_text, ground_truth, data_source, extra_info)
