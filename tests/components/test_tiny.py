"""Tests for the tiny model and byte-level tokenizer builders (components/tiny.py)."""

import ast

import pytest
import torch

from components.tiny import EOS_TOKEN, PAD_TOKEN, TinyModelSpec, build_tiny_model, build_tokenizer

SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), SPEC)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.mark.parametrize("text", ["12+34=46 hello", "a\nb\tc  d", "café → ü", ""])
def test_saved_tokenizer_round_trip_is_byte_level(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, id == byte value
    assert tokenizer.decode(ids) == text


def test_round_trip_example_from_the_brief(tokenizer):
    text = "12+34=46 hello"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 14 == len(text.encode())
    assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token_id == 256
    assert tokenizer.pad_token_id == 257
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [258, 259]
    assert len(tokenizer) == 260
    assert tokenizer.bos_token_id is None
    # a special token in text is one id, and decoding can drop it
    assert tokenizer("46" + EOS_TOKEN, add_special_tokens=False)["input_ids"] == [52, 54, 256]
    assert tokenizer.decode([52, 54, 256], skip_special_tokens=True) == "46"
    # encoding adds nothing by default (no BOS/EOS)
    assert tokenizer("12")["input_ids"] == [49, 50]


def test_chat_template_renders_user_content_only(tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "12+34="}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "12+34="
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "12+34="
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False) == "1+1="


def test_in_memory_tokenizer_matches_saved(tokenizer):
    built = build_tokenizer()
    text = "12+34=46 hello"
    assert built(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert built.eos_token_id == tokenizer.eos_token_id and built.pad_token_id == tokenizer.pad_token_id


def test_saved_model_config(model_path):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(model_path))
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size) == (64, 1, 1, 1, 128)
    assert config.head_dim == 64
    assert config.vocab_size == 260
    assert config.eos_token_id == 256 and config.pad_token_id == 257
    assert config.tie_word_embeddings
    generation = GenerationConfig.from_pretrained(str(model_path))
    assert generation.eos_token_id == 256 and generation.pad_token_id == 257
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.shape == (260, 64)
    recorded = ast.literal_eval((model_path / "tiny_spec.txt").read_text())
    assert recorded == {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1,
                        "num_key_value_heads": 1, "intermediate_size": 128, "max_position_embeddings": 512,
                        "vocab_size": None, "seed": 0}


def test_seed_controls_weights(tmp_path, model_path):
    from transformers import AutoModelForCausalLM

    same = build_tiny_model(tmp_path / "same", SPEC)
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(**{**SPEC.__dict__, "seed": 1}))
    base, again, different = (AutoModelForCausalLM.from_pretrained(str(p)) for p in (model_path, same, other))
    for name, parameter in base.state_dict().items():
        assert torch.equal(parameter, again.state_dict()[name]), name
    assert not torch.equal(base.model.embed_tokens.weight, different.model.embed_tokens.weight)


def test_default_spec_is_valid():
    spec = TinyModelSpec()
    assert spec.hidden_size // spec.num_attention_heads == 64


def test_presets_have_the_qwen_shapes():
    from components.tiny import PRESETS

    half_billion = PRESETS["qwen2.5-0.5b"]
    assert (half_billion.hidden_size, half_billion.num_hidden_layers, half_billion.vocab_size) == (896, 24, 151936)
    assert PRESETS["qwen2.5-1.5b"].hidden_size // PRESETS["qwen2.5-1.5b"].num_attention_heads == 128


@pytest.mark.parametrize(("hidden", "heads", "match"), [
    (96, 1, "must be 64 or 128"), (64, 2, "must be 64 or 128"), (512, 2, "must be 64 or 128"), (100, 3, "multiple of"),
])
def test_spec_head_size_validation(hidden, heads, match):
    with pytest.raises(ValueError, match=match) as error:
        TinyModelSpec(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=1)
    assert "tiny." in str(error.value)
