"""What bench/trl_grpo.py (speed) and bench/trl_learning.py (learning curve) share: TRL 1.16.0's GRPOConfig of one
process and one generation round per optimizer step, and torch.distributed's single-process variables."""

from __future__ import annotations

import os
import socket


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_single_process_env() -> dict:
    """torch.distributed variables for one process, unless a launcher already set them.

    Called after GRPOConfig exists: accelerate's state is built inside GRPOConfig.__post_init__, and a
    LOCAL_RANK seen then would make it start a 1-process NCCL group and wrap the model in DDP. TRL's
    colocate init (trl/generation/vllm_generation.py, `_init_vllm`) sets RANK/LOCAL_RANK/WORLD_SIZE
    again from the accelerator and MASTER_ADDR/PORT through `ensure_master_addr_port`, respecting these.
    """
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port())}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in defaults}


def one_round_grpo_config(output_dir: str, *, prompts: int, n: int, micro_batch: int, device: str, seed: int,
                          **knobs):
    """A GRPOConfig of one process and one generation round per optimizer step: prompts × n completions from the
    colocated vLLM engine (no sleep mode, tensor parallel 1), one optimizer step over them in micro-batches of
    micro_batch (gradients accumulated), bf16 autocast, a constant learning rate, no gradient checkpointing (TRL's
    default is True), no evaluation, checkpoints or trackers, a log line every step. `knobs` are the caller's other
    GRPOConfig fields. Raises when TRL resolves the batch to anything else."""
    from trl import GRPOConfig

    sequences = prompts * n
    config = GRPOConfig(
        output_dir=output_dir,
        # GRPOConfig.__post_init__ sets steps_per_generation = gradient_accumulation_steps and
        # generation_batch_size = per_device_train_batch_size × world_size × steps_per_generation.
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=sequences // micro_batch,
        num_generations=n,
        num_iterations=1,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_tensor_parallel_size=1,
        vllm_enable_sleep_mode=False,
        lr_scheduler_type="constant",
        bf16=True,
        gradient_checkpointing=False,
        use_cpu=device == "cpu",
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        seed=seed,
        **knobs,
    )
    expected = {"steps_per_generation": sequences // micro_batch, "generation_batch_size": sequences, "world_size": 1}
    got = {key: getattr(config, key) for key in expected}
    if got != expected:
        raise RuntimeError(f"GRPOConfig resolved to {got}, expected {expected}: one process, one generation "
                           "round per optimizer step")
    return config
