"""A test-only reward (`reward.function=dense_reward:digit_share`): the share of digits in the response.
Unlike exact match, a random tiny model's responses score differently within a group, so GRPO's
advantages, gradients and updates are not all zero without a warm-start."""


def digit_share(response_text, ground_truth, data_source="", extra_info=None):
    return sum(character.isdigit() for character in response_text) / max(len(response_text), 1)
