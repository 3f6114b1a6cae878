"""A test-only reward (`reward.function=tool_reward:policy_digits`) that needs the conversation's transcript: the
share of digits in the policy's last turn (extra_info.messages), which differs between samples of a group, so
GRPO's advantages are not all zero. It raises when extra_info carries no transcript."""


def policy_digits(response_text, ground_truth, extra_info=None):
    messages = extra_info["messages"]  # KeyError: the reward did not see the whole conversation
    assert extra_info["turns"] == sum(message["role"] == "assistant" for message in messages)
    last = [message["content"] for message in messages if message["role"] == "assistant"][-1]
    return sum(character.isdigit() for character in last) / max(len(last), 1) + 0.01 * len(last)
