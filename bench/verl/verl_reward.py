"""verl custom reward (reward.custom_reward_function.path=bench/verl/verl_reward.py, name=compute_score): the share of
digits in the response, rlhf-flow's bench reward (bench/common.py digit_fraction, bench/trl_grpo.py)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)
