"""Loading models and tokenizers: hub names and local folders go through the same code.

Attention: flash-attn when it is installed and the model runs on a GPU in half precision, else
PyTorch SDPA (flash-attn is optional; it has no wheels on the index used here).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Literal

import torch
from pydantic import AliasChoices, Field, field_validator

from components.settings import Section

TOKENIZER_PROBE = "hello world 12"
"""The text a loaded tokenizer must encode to tokens and decode back (case and spacing aside)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Dtype = Literal["float32", "bfloat16", "float16"]


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` -> the first visible CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={device!r}: no CUDA device is visible; use cpu or auto")
    return torch.device(device)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"model.compute_dtype={name!r} is not one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_attn_implementation(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Pick the attention kernel; `auto` never fails, an explicit flash_attention_2 must be possible."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    half = dtype in (torch.bfloat16, torch.float16)
    if requested == "auto":
        return "flash_attention_2" if has_flash and device.type == "cuda" and half else "sdpa"
    if requested == "flash_attention_2" and not (has_flash and device.type == "cuda" and half):
        raise ValueError(
            "model.attn_implementation='flash_attention_2' needs the flash-attn package, a CUDA device "
            "and bfloat16/float16; use auto or sdpa"
        )
    return requested


def check_model_source(path: str, field: str = "model.path", needs_config: bool = False) -> None:
    """A value that looks like a local path must exist and be a folder, with `needs_config` one with a readable
    config.json (a model, not only a tokenizer); hub names are left to from_pretrained."""
    looks_local = path.startswith((".", "/", "~")) or Path(path).exists()
    local = Path(path).expanduser()
    if looks_local and not local.exists():
        raise ValueError(
            f"{field}={path!r} does not exist; give a local model folder or a Hugging Face hub name "
            "(`rlhf make-tiny-model DIR` writes a tiny one)"
        )
    if not looks_local:
        return
    if not local.is_dir():
        raise ValueError(f"{field}={path!r} is a file, not a model folder; give the folder that holds its "
                         "config.json (or a Hugging Face hub name)")
    config = local / "config.json"
    if not needs_config:
        return
    if not config.is_file():
        raise ValueError(f"{field}={path!r} has no config.json, so it is not a Hugging Face model folder; give "
                         "the folder from save_pretrained (or a hub name)")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{field}={path!r}: {str(config)!r} is not UTF-8 text (byte 0x{error.object[error.start]:02x} "
                         f"at position {error.start}); write config.json as UTF-8 JSON") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{field}={path!r}: {str(config)!r} is not valid JSON (line {error.lineno}, column "
                         f"{error.colno}: {error.msg}); give the config.json save_pretrained writes") from None


def model_source(path: str) -> str:
    local = Path(path).expanduser()
    return str(local) if local.exists() else path


def load_tokenizer(path: str, trust_remote_code: bool = False, field: str = "model.path", check: bool = False):
    """The model's tokenizer, with a pad token (the EOS token when the model defines none); ValueError naming
    `field` when it does not load, and with `check` when a round trip of a short text fails (check_tokenizer).

    `check` is off by default because roles load a tokenizer from weights folders that hold none (published
    weights/actor/<k>, which from_pretrained turns into an empty vocabulary); preflight checks model.path."""
    # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
    from transformers import AutoTokenizer

    check_model_source(path, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_source(path), trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers and tokenizers fail with anything on a broken folder
        detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(f"{field}={path!r}: its tokenizer does not load ({type(error).__name__}: {detail}); give "
                         "a model folder with its tokenizer files (tokenizer.json, tokenizer_config.json) or a hub "
                         "name") from error
    if check:
        check_tokenizer(tokenizer, path, field)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_tokenizer(tokenizer, path: str, field: str = "model.path") -> None:
    """Encode and decode TOKENIZER_PROBE: a tokenizer that gives no tokens or another text back is broken (a
    model folder without tokenizer files loads as an empty vocabulary, which turns every prompt into 0 tokens)."""
    ids = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{field}={path!r}: its tokenizer is broken: it encodes {TOKENIZER_PROBE!r} to no tokens "
                         "(are the tokenizer files, tokenizer.json or vocab.json and merges.txt, missing?); give a "
                         "model folder with its tokenizer files or a hub name")
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    if " ".join(decoded.split()).lower() != TOKENIZER_PROBE:
        raise ValueError(f"{field}={path!r}: its tokenizer is broken: {TOKENIZER_PROBE!r} encodes to {len(ids)} "
                         f"tokens that decode to {decoded!r}; give a model folder with its tokenizer files or a "
                         "hub name")


def load_pretrained(
    auto_class,
    path: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "auto",
    attn_implementation: str = "auto",
    trust_remote_code: bool = False,
    compute_dtype: str | torch.dtype | None = None,
    **kwargs,
):
    """`auto_class.from_pretrained` on the chosen device, dtype and attention kernel.

    `dtype` is the parameters' dtype; `compute_dtype` (default: the same) the one attention runs in, which
    decides whether flash-attn applies (fp32 master weights computing in bf16 under autocast can use it)."""
    check_model_source(path)
    device = resolve_device(device) if isinstance(device, str) else device
    torch_dtype = resolve_dtype(dtype)
    attention_dtype = torch_dtype if compute_dtype is None else resolve_dtype(compute_dtype)
    model = auto_class.from_pretrained(
        model_source(path),
        dtype=torch_dtype,
        attn_implementation=resolve_attn_implementation(attn_implementation, device, attention_dtype),
        trust_remote_code=trust_remote_code,
        **kwargs,
    )
    return model.to(device)


def load_causal_lm(path: str, **kwargs):
    # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
    from transformers import AutoModelForCausalLM

    return load_pretrained(AutoModelForCausalLM, path, **kwargs)


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each transformer block of `model` in place; returns how many were compiled.

    Regional compilation: the blocks share one code object, so the compiler traces one block once and
    every layer reuses it (seconds, not the minutes of a whole-model compile). Inductor fuses what runs
    between the matmuls (RMSNorm, rotary embedding, SiLU * up, residual adds) in forward and backward.
    A new sequence length recompiles once, after which lengths are dynamic; so does the first new row count, and a
    micro-batch of a single row (flows.training.roles.announcing_recompiles says so when it happens).
    The first micro-batch without padding compiles once more too (transformers passes no mask then; SDPA takes
    is_causal). On CUDA the cut lengths are multiples of 8 (components.batch.ALIGNED), else the first length
    that is not compiles again. Starting dynamic (dynamic=True) was measured and did not help (bench/README.md).
    """
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            for layer in module:
                layer.compile(backend=backend)
                count += 1
    return count


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far: each compile and each recompile (a guard on a shape
    failed) adds one; 0 before torch's compiler is first used."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def declared_eos_ids(path: str, trust_remote_code: bool = False) -> list[int]:
    """Every end-of-sequence id a model folder (or hub name) declares: generation_config.json's eos_token_id (an
    id or a list), else config.json's; [] when it declares none. The rollout stops at each of them."""
    # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
    from transformers import AutoConfig, GenerationConfig

    source = model_source(path)
    try:
        declared = GenerationConfig.from_pretrained(source).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        declared = None
    if declared is None:
        try:
            declared = getattr(AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code),
                               "eos_token_id", None)
        except (OSError, ValueError):
            declared = None
    return id_list(declared)


def id_list(declared) -> list[int]:
    """An eos_token_id setting (None, an id or a list of ids) as a list of ids."""
    if declared is None:
        return []
    return [int(token) for token in (declared if isinstance(declared, (list, tuple)) else [declared])]


def eos_ids(tokenizer, declared: list[int] | None = None) -> list[int]:
    """The tokenizer's eos id first, then the model's other declared ones: where generation ends."""
    eos = getattr(tokenizer, "eos_token_id", None)  # no tokenizer: an engine fed token ids only (tests, benches)
    first = [] if eos is None else [int(eos)]
    return list(dict.fromkeys(first + list(declared or [])))


def check_eos(tokenizer, path: str, field: str = "model.path", trust_remote_code: bool = False) -> list[int]:
    """The model's eos ids (eos_ids); ValueError when the tokenizer's eos is not one the model declares (the
    rollout would stop where the model never ends its turn, or run past where it does)."""
    declared = declared_eos_ids(path, trust_remote_code)
    if tokenizer.eos_token_id is None:
        if not declared:
            raise ValueError(f"{field}={path!r}: neither its tokenizer nor its generation_config.json names an "
                             "end-of-sequence token, so no response could stop before the length limit; set "
                             "eos_token in tokenizer_config.json")
        return declared
    if declared and int(tokenizer.eos_token_id) not in declared:
        names = ", ".join(f"{token} ({tokenizer.convert_ids_to_tokens(token)!r})" for token in declared)
        raise ValueError(
            f"{field}={path!r}: its tokenizer's eos is {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) but its "
            f"generation_config.json/config.json declare eos_token_id {names}; make them agree (eos_token in "
            "tokenizer_config.json, or eos_token_id in generation_config.json), e.g. rebuild the folder with "
            "`rlhf make-model`")
    return eos_ids(tokenizer, declared)


# The run's `model` section (flows/config.py composes it).
class ModelConfig(Section):
    path: str = ".rlhf/models/tiny-qwen2"
    """Hugging Face hub name or local folder of the policy to train."""
    compute_dtype: Dtype = Field("float32", validation_alias=AliasChoices("compute_dtype", "dtype"))
    """The dtype every model computes in (forward and backward): the rollout engine, reference and reward model
    hold their weights in it, and the actor's published weights and exports are cast to it. `dtype` is accepted
    as its old name."""
    master_dtype: Dtype = "float32"
    """The dtype of the trained roles' (actor, critic, warm-start) parameters, gradients and optimizer state.
    float32 (default; verl's FSDP mixed precision): fp32 master weights, forward and backward in compute_dtype
    under torch.autocast (FSDP2 MixedPrecisionPolicy when sharded, gradients reduced in fp32). Equal to a 16-bit
    compute_dtype: pure 16-bit training, half the memory, but every AdamW step smaller than half a bf16 ulp of
    its weight (|w| 0.02 -> 6e-5, far above the 1e-6 learning rates of RL) rounds away: a run warns."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass of the trained roles (actor,
    critic, warm-start) instead of storing them: less memory for longer sequences or larger micro-batches,
    about a third more update time."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """auto: flash-attn when installed and on a GPU, else PyTorch SDPA."""
    fused_logprobs: bool = True
    """On CUDA, token log-probs and entropy of the actor and reference by one Triton kernel straight from
    the LM head's logits (no float32 [B, T, V] copy); false: the plain PyTorch expression. Same values."""
    compile: bool = True
    """On CUDA, torch.compile each transformer block of the actor and critic (regional compilation): fuses
    the norms, rotary embedding and activations between the matmuls (a 0.5B update: 1.48x faster, 19%
    less memory). Costs a compile of about 8 s in the first update, and one more for each new kind of batch
    (the first new length and row count, a micro-batch without padding, one of a single row; each once, and a
    line says so); ignored on the CPU and when the model is sharded (FSDP). false: eager PyTorch."""
    trust_remote_code: bool = False
    """Passed to from_pretrained (only for hub models you trust)."""
    from_run: str | None = None
    """Start from the latest committed actor weights of this earlier run (under run.storage_root),
    e.g. a nightly run continuing yesterday's; model.path still gives the tokenizer."""
    lora_rank: int = Field(0, ge=0)
    """LoRA rank of the trained roles (actor, critic), as verl's model.lora_rank; 0: off, full fine-tuning. On:
    only the adapters (peft) train and hold AdamW state, the rollout gets the merged weights, the reference is the
    base model with the adapter disabled (components/lora.py). LoRA often wants a larger actor.optim.lr than
    full fine-tuning (on the quickstart, rank 8, 2e-4 and 2e-3 learned alike)."""
    lora_alpha: float = Field(16, gt=0)
    """LoRA scaling numerator: the adapter's delta is (lora_alpha / lora_rank) * B @ A."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' inputs while training (0: the update's forward equals the log-prob pass's)."""
    target_modules: str | list[str] = "all-linear"
    """The layers that get adapters: all-linear (every linear layer but the LM head) or a list of module names
    (e.g. [q_proj, k_proj, v_proj, o_proj])."""

    @field_validator("target_modules")
    @classmethod
    def _check_target_modules(cls, value):
        if isinstance(value, str):
            if value != "all-linear":
                raise ValueError("give 'all-linear' or a list of module names, e.g. [q_proj, v_proj]")
            return value
        if not value or not all(isinstance(name, str) and name.strip() for name in value):
            raise ValueError("give 'all-linear' or a non-empty list of module names, e.g. [q_proj, v_proj]")
        return value
