"""Inputs for bench/verl/verl_bench.sh (verl 0.9.1's GRPO at rlhf-flow's bench/step.py knobs), and its read-outs.

    python3 bench/verl/verl_bench_setup.py model DIR [--preset qwen2.5-0.5b]   # random Qwen2 model + byte-level tokenizer
    python3 bench/verl/verl_bench_setup.py data MODEL_DIR OUT.parquet [--prompts 256] [--tokens 256]
    python3 bench/verl/verl_bench_setup.py summary LOG OUT.json [--warmup 1]     # verl's console metric lines -> table + JSON
    python3 bench/verl/verl_bench_setup.py compare MODEL_DIR HF_DIR [--json OUT]  # final actor weights against the initial
    python3 bench/verl/verl_bench_setup.py validate OVERRIDE...                  # compose verl's config, run its checks

The model is the product's `qwen2.5-0.5b` preset (components/tiny.py, copied here because the GPU call carries
only this repo): Qwen2 architecture, 24 layers, hidden 896, 14 heads, 2 KV heads, head size 64, MLP 4864,
vocabulary 151,936, tied LM head, random weights (seed 0, float32 init, saved as bfloat16 like bench/common.py's
make_random_model), and a Qwen2Tokenizer whose vocabulary is the 256 byte symbols plus <|endoftext|>, <|pad|>,
<|im_start|>, <|im_end|>, with the chat template "user turns verbatim". So a prompt of 256 letters is exactly
256 tokens after verl's apply_chat_template(add_generation_prompt=True), as bench/rollout.py's prompts are.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import sys
from pathlib import Path

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
EXTRA_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['role'] != 'system' %}"
                 "{{ message['content'] }}{% endif %}{% endfor %}")
PRESETS = {  # components/tiny.py
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=512, max_position_embeddings=512, vocab_size=None),
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, max_position_embeddings=32768, vocab_size=151936),
}


def build_tokenizer():
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()
    tokenizer = Qwen2Tokenizer(vocab={symbols[b]: b for b in range(256)}, merges=[], unk_token=None, bos_token=None,
                               eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN, "additional_special_tokens": EXTRA_SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(out: Path, preset: str) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").is_file() and (out / "bench_preset.txt").is_file() \
            and (out / "bench_preset.txt").read_text().strip() == preset:
        print(f"model: reusing {out}")
        return
    spec = PRESETS[preset]
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=spec["vocab_size"] or len(tokenizer), hidden_size=spec["hidden_size"],
                         intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
                         num_attention_heads=spec["num_attention_heads"],
                         num_key_value_heads=spec["num_key_value_heads"],
                         head_dim=spec["hidden_size"] // spec["num_attention_heads"],
                         max_position_embeddings=spec["max_position_embeddings"], bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "bench_preset.txt").write_text(preset + "\n")
    count = sum(p.numel() for p in model.parameters())
    print(f"model: {preset}, {count:,} parameters, bf16, tokenizer of {len(tokenizer)} tokens -> {out}")


def chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def write_data(model_dir: Path, path: Path, prompts: int, tokens: int, seed: int = 0) -> None:
    """verl's RL parquet layout: prompt (chat list), data_source, ability, reward_model.ground_truth, extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    rows = []
    for index in range(prompts):  # bench/rollout.py's write_fixed_prompts: lowercase letters and spaces
        text = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(tokens))
        messages = [{"role": "user", "content": text}]
        length = len(chat_ids(tokenizer, messages))
        if length != tokens:
            raise SystemExit(f"prompt {index} is {length} tokens after the chat template, wanted {tokens}")
        rows.append({"data_source": "digits", "prompt": messages, "ability": "digits",
                     "reward_model": {"style": "rule", "ground_truth": "0"},
                     "extra_info": {"split": "train", "index": index}})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"data: {prompts} prompts of {tokens} tokens (chat template applied) -> {path}")


LINE = re.compile(r"step:(\d+) - (.*)$")
SHOW = ["timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/adv",
        "timing_s/update_actor", "timing_s/update_weights", "timing_s/save_checkpoint",
        "actor/grad_norm", "actor/pg_loss", "actor/lr", "critic/score/mean", "critic/advantages/max",
        "response_length/mean", "response_length/clip_ratio", "prompt_length/mean",
        "training/rollout_probs_diff_mean", "perf/throughput", "perf/mfu/actor", "perf/max_memory_allocated_gb",
        "perf/max_memory_reserved_gb"]


def summary(log: Path, out: Path, warmup: int) -> None:
    steps: dict[int, dict[str, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = LINE.search(line)
        if not match or " - " not in line:
            continue
        record = {}
        for item in match.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            try:
                record[key.strip()] = float(value)
            except ValueError:
                pass
        if "timing_s/step" in record:
            steps[int(match.group(1))] = record
    if not steps:
        print("summary: no step lines (step:N - ... timing_s/step:...) in the log")
        out.write_text(json.dumps({"bench": "verl_grpo", "steps": {}}, indent=1))
        return
    keys = [k for k in SHOW if any(k in r for r in steps.values())]
    keys += sorted(k for k in {k for r in steps.values() for k in r}
                   if k.startswith("timing_s/") and k not in keys)
    print("| metric | " + " | ".join(f"step {s}" for s in sorted(steps)) + " |")
    print("| --- |" + " --- |" * len(steps))
    for key in keys:
        cells = [steps[s].get(key) for s in sorted(steps)]
        print(f"| {key} | " + " | ".join("" if c is None else f"{c:.4g}" for c in cells) + " |")
    # verl times a step's checkpoint (VERL_SAVE_HF=1) inside its timing_s/step: taken out, as the product's
    # bench/step.py writes its one checkpoint outside the step
    measured = [steps[s]["timing_s/step"] - steps[s].get("timing_s/save_checkpoint", 0.0)
                for s in sorted(steps) if s > warmup]
    result = {"bench": "verl_grpo", "system": "verl", "warmup": warmup, "steps": steps,
              "step_s_all": measured, "step_s": statistics.mean(measured) if measured else None,
              "stage_s": {k[len("timing_s/"):]: statistics.mean(v) for k in keys if k.startswith("timing_s/")
                          and (v := [steps[s][k] for s in sorted(steps) if s > warmup and k in steps[s]])}}
    if result["step_s"]:
        result["gen_tokens_per_s"] = 64 * 8 * 512 / result["step_s"]
    out.write_text(json.dumps(result, indent=1))
    grad = [steps[s].get("actor/grad_norm") for s in sorted(steps)]
    print(f"verl step s after {warmup} warm-up: {[round(x, 2) for x in measured]} mean "
          f"{result['step_s']:.2f}" if measured else "no measured steps", "| grad_norm per step:", grad)


def compare(model_dir: Path, hf_dir: Path, out: Path | None = None) -> None:
    """The saved actor against the initial model with bench/common.py's comparison, the one every product and TRL
    row uses (it needs torch and safetensors alone, which verl's site has from the image)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.common import SafetensorsWeights, compare_weights

    initial, final = SafetensorsWeights(model_dir), SafetensorsWeights(hf_dir)
    weights = {**compare_weights(initial, final), "weights_final_dtypes": sorted(set(final.dtypes.values())),
               "weights_final_dir": str(hf_dir)}
    if out is not None:  # into the summary's JSON, beside the step times
        result = json.loads(out.read_text()) if out.exists() else {}
        out.write_text(json.dumps({**result, **weights}, indent=1))
    print(f"weights: {weights['weights_compared_tensors']} tensors compared (final dtypes "
          f"{weights['weights_final_dtypes']}): changed {weights['weights_changed_fraction']:.4%}, RMS(dw)/RMS(w0) "
          f"{weights['weights_rms_ratio']:.3e}; only initial {weights['weights_only_initial'][:3]}, only final "
          f"{weights['weights_only_final'][:3]}")


def validate(overrides: list[str]) -> int:
    """Compose verl's ppo_trainer config with `overrides` as main_ppo does (hydra), run verl's validate_config,
    and, where the files exist, load the parquet with verl's RLHFDataset and score one response with the custom
    reward through verl's own loader. CPU only: no Ray, no GPU."""
    import os

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    use_ref, use_critic = need_reference_policy(config), need_critic(config)
    validate_config(config=config, use_reference_policy=use_ref, use_critic=use_critic)
    r, a = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    print(f"config ok: reference policy {use_ref}, critic {use_critic}, use_v1 {config.trainer.use_v1} "
          f"({config.trainer.v1.trainer_mode}), rollout {r.name}/{r.mode} n={r.n} tp={r.tensor_model_parallel_size} "
          f"ignore_eos={r.ignore_eos} prompt/response {r.prompt_length}/{r.response_length} "
          f"max_num_seqs={r.max_num_seqs} max_num_batched_tokens={r.max_num_batched_tokens} "
          f"gpu_memory_utilization={r.gpu_memory_utilization} free_cache_engine={r.free_cache_engine}; actor "
          f"mini {a.ppo_mini_batch_size} micro {a.ppo_micro_batch_size_per_gpu} lr {a.optim.lr} "
          f"model_dtype {a.fsdp_config.model_dtype} dtype {a.fsdp_config.dtype} "
          f"gradient_checkpointing {config.actor_rollout_ref.model.enable_gradient_checkpointing} "
          f"remove_padding {config.actor_rollout_ref.model.use_remove_padding} "
          f"attn {OmegaConf.select(config, 'actor_rollout_ref.model.override_config.attn_implementation')}")
    model_path, train = config.actor_rollout_ref.model.path, config.data.train_files
    if os.path.isdir(model_path) and os.path.isfile(train):
        from verl.utils import hf_tokenizer
        from verl.utils.dataset.rl_dataset import RLHFDataset

        tokenizer = hf_tokenizer(model_path)
        data_config = OmegaConf.to_container(config.data, resolve=False)
        data_config["dataloader_num_workers"] = 0
        dataset = RLHFDataset(data_files=[train], tokenizer=tokenizer, config=OmegaConf.create(data_config))
        row = dataset[0]
        ids = chat_ids(tokenizer, list(row["raw_prompt"]))
        print(f"dataset ok: {len(dataset)} rows; row 0 keys {sorted(row)}; raw_prompt role "
              f"{row['raw_prompt'][0]['role']}, {len(ids)} tokens after the chat template; data_source "
              f"{row.get('data_source')}; ground_truth {row['reward_model']['ground_truth']}; "
              f"extra_info {row.get('extra_info')}")
        if len(ids) != config.data.max_prompt_length:
            print("PROBLEM: prompt length differs from data.max_prompt_length")
            return 1
    fn_path = config.reward.custom_reward_function.path
    if fn_path and os.path.isfile(fn_path):
        from verl.trainer.ppo.reward import get_custom_reward_fn

        fn = get_custom_reward_fn(config)
        score = fn(data_source="digits", solution_str="ab12", ground_truth="0", extra_info={"index": 0})
        print(f"reward ok: compute_score('ab12') = {score} through verl's get_custom_reward_fn")
        if abs(score - 0.5) > 1e-9:
            return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("model")
    p.add_argument("dir")
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p = sub.add_parser("data")
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p = sub.add_parser("summary")
    p.add_argument("log")
    p.add_argument("out")
    p.add_argument("--warmup", type=int, default=1)
    p = sub.add_parser("validate")
    p.add_argument("overrides", nargs="*")
    p = sub.add_parser("compare")
    p.add_argument("model_dir")
    p.add_argument("hf_dir")
    p.add_argument("--json", default=None, help="add the comparison to this summary JSON")
    args = parser.parse_args()
    if args.cmd == "model":
        build_model(Path(args.dir), args.preset)
    elif args.cmd == "data":
        write_data(Path(args.model_dir), Path(args.out), args.prompts, args.tokens)
    elif args.cmd == "summary":
        summary(Path(args.log), Path(args.out), args.warmup)
    elif args.cmd == "validate":
        return validate(args.overrides)
    else:
        compare(Path(args.model_dir), Path(args.hf_dir), Path(args.json) if args.json else None)


if __name__ == "__main__":
    sys.exit(main())
