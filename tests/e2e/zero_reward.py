"""A test-only reward (`reward.function=zero_reward:always_zero`): 0 for every response, so every group of samples
gets the same reward and the run has no learning signal (issue 36's run, in seconds)."""


def always_zero(response_text, ground_truth, data_source="", extra_info=None):
    return 0.0
