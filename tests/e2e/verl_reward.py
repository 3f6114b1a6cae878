"""A reward file as a verl user writes it (`custom_reward_function.path`, `compute_score`), used unchanged
as `reward.function=verl_reward:compute_score`. It records every call so the test can check what it got."""

import json
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["VERL_REWARD_LOG"], "a") as log:
        log.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info}) + "\n")
    # digits in the response, so a random tiny model's samples differ within a group
    return sum(character.isdigit() for character in solution_str) / max(len(solution_str), 1)
