"""Tiny models built from a config, for the quickstart, the tests and speed work.

No weights can be downloaded here, so the project makes its own: a Qwen2-architecture causal LM with
random weights and a byte-level BPE tokenizer with no merges (every byte is one token). Both are
written with `save_pretrained`, so everything downstream loads them through the same code path as a
hub model (`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`, and vLLM).

Why byte-level: for `model_type: qwen2`, transformers 5 forces its Qwen2Tokenizer (a byte-level
pre-tokenizer) whatever tokenizer_config.json says, so a word-level vocabulary silently encodes to
nothing. A Qwen2 tokenizer whose vocabulary is exactly the 256 byte symbols round-trips any text.

Attention head size stays 64: vLLM's CPU backend rejects 16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EXTRA_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
# The simplest chat template that still exercises the chat-template path: user turns verbatim.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['content'] }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny Qwen2 model. Defaults run on a 2-core CPU in milliseconds per step."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    vocab_size: int | None = None
    """Embedding rows; None: the tokenizer's size. Larger pads the embedding like real models do."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"tiny.hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_size // self.num_attention_heads not in (64, 128):
            raise ValueError(
                f"tiny.hidden_size/num_attention_heads={self.hidden_size // self.num_attention_heads}"
                " must be 64 or 128 (vLLM's CPU backend rejects small head sizes such as 16)"
            )


PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    # The shapes of Qwen2.5-0.5B, -1.5B and -3B (random weights, byte-level tokenizer), for GPU work. All three
    # tie the LM head to the embedding, as tiny_config does for every preset.
    "qwen2.5-0.5b": TinyModelSpec(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                  num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768,
                                  vocab_size=151936),
    "qwen2.5-1.5b": TinyModelSpec(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                  num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                                  vocab_size=151936),
    "qwen2.5-3b": TinyModelSpec(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                                num_key_value_heads=2, intermediate_size=11008, max_position_embeddings=32768,
                                vocab_size=151936),
    # Qwen2.5-7B's body (its LM head is untied; tied here as every preset: 7.07B parameters instead of 7.62B)
    "qwen2.5-7b": TinyModelSpec(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                num_key_value_heads=4, intermediate_size=18944, max_position_embeddings=32768,
                                vocab_size=152064),
}


def build_tokenizer():
    """A Qwen2Tokenizer over the 256 byte symbols plus end-of-text, pad and chat markers."""
    # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = bytes_to_unicode()
    vocab = {byte_symbols[byte]: byte for byte in range(256)}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    tokenizer.add_special_tokens(
        {"pad_token": PAD_TOKEN, "additional_special_tokens": list(EXTRA_SPECIAL_TOKENS)}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(output_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight Qwen2 causal LM and its tokenizer to `output_dir`; return the path."""
    # on use: `rlhf make tiny-model` and the CLI's startup must not pay for torch and transformers
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    tokenizer = build_tokenizer()
    config = tiny_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    (output_dir / "tiny_spec.txt").write_text(repr(asdict(spec)) + "\n")
    return output_dir


def tiny_config(spec: TinyModelSpec, tokenizer=None):
    """The transformers Qwen2Config of `spec` (no weights: enough to count parameters or plan placement)."""
    # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
    from transformers import Qwen2Config

    tokenizer = tokenizer or build_tokenizer()
    if spec.vocab_size is not None and spec.vocab_size < len(tokenizer):
        raise ValueError(f"tiny.vocab_size={spec.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    return Qwen2Config(
        vocab_size=spec.vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
