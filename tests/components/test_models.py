"""Tests for device/dtype/attention resolution and model/tokenizer loading (components/models.py)."""

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from components import models
from components.models import (
    check_model_source,
    check_tokenizer,
    load_causal_lm,
    load_pretrained,
    load_tokenizer,
    resolve_attn_implementation,
    resolve_device,
    resolve_dtype,
)
from components.tiny import TinyModelSpec, build_tiny_model, build_tokenizer

SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), SPEC)


@pytest.mark.parametrize(("name", "dtype"), [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("float16", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype(name, dtype):
    assert resolve_dtype(name) is dtype


@pytest.mark.parametrize("name", ["fp16", "float64", "bf16", ""])
def test_resolve_dtype_error_names_the_field(name):
    with pytest.raises(ValueError, match=r"model\.compute_dtype") as error:
        resolve_dtype(name)
    assert repr(name) in str(error.value)
    assert "float32" in str(error.value) and "bfloat16" in str(error.value)


@no_cuda
def test_resolve_device_on_cpu():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device() == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attn_auto_is_sdpa_on_cpu(dtype):
    assert resolve_attn_implementation("auto", torch.device("cpu"), dtype) == "sdpa"


@pytest.mark.parametrize("requested", ["sdpa", "eager"])
def test_attn_explicit_choice_is_kept(requested):
    assert resolve_attn_implementation(requested, torch.device("cpu"), torch.float32) == requested


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_flash_on_cpu_raises(dtype):
    with pytest.raises(ValueError, match=r"model\.attn_implementation='flash_attention_2'"):
        resolve_attn_implementation("flash_attention_2", torch.device("cpu"), dtype)


def _pretend_flash_attn_installed(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return object() if name == "flash_attn" else real(name, *args, **kwargs)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)


def test_attn_with_flash_installed(monkeypatch):
    _pretend_flash_attn_installed(monkeypatch)
    cuda = torch.device("cuda")
    assert resolve_attn_implementation("auto", cuda, torch.bfloat16) == "flash_attention_2"
    assert resolve_attn_implementation("auto", cuda, torch.float16) == "flash_attention_2"
    assert resolve_attn_implementation("auto", cuda, torch.float32) == "sdpa"
    assert resolve_attn_implementation("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert resolve_attn_implementation("flash_attention_2", cuda, torch.bfloat16) == "flash_attention_2"
    with pytest.raises(ValueError):
        resolve_attn_implementation("flash_attention_2", cuda, torch.float32)
    with pytest.raises(ValueError):
        resolve_attn_implementation("flash_attention_2", torch.device("cpu"), torch.bfloat16)


def test_attn_without_flash_installed_on_cuda(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "flash_attn" else real(name, *a, **k))
    assert resolve_attn_implementation("auto", torch.device("cuda"), torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="flash-attn"):
        resolve_attn_implementation("flash_attention_2", torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("path", ["./does-not-exist", "/definitely/not/here", "~/no-such-model-dir-xyz",
                                  "../nope/model"])
def test_check_model_source_missing_local_path(path):
    with pytest.raises(ValueError, match=r"model\.path") as error:
        check_model_source(path)
    assert repr(path) in str(error.value)


def test_check_model_source_custom_field():
    with pytest.raises(ValueError, match=r"critic\.model_path='\./missing'"):
        check_model_source("./missing", field="critic.model_path")


@pytest.mark.parametrize("name", ["org/name", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2"])
def test_check_model_source_hub_names_pass(name):
    check_model_source(name)  # left to from_pretrained


def test_check_model_source_existing_folder(model_path):
    check_model_source(str(model_path))


def test_load_tokenizer_missing_path_fails_early():
    with pytest.raises(ValueError, match=r"model\.path"):
        load_tokenizer("./does-not-exist")


def test_a_tokenizer_is_checked_by_a_round_trip(model_path, tmp_path):
    check_tokenizer(load_tokenizer(str(model_path)), str(model_path))  # the tiny one round-trips

    class Lossy:  # e.g. a vocabulary without these characters
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3, 3]}

        def decode(self, ids, skip_special_tokens=False):
            return "<unk><unk>"

    with pytest.raises(ValueError) as error:
        check_tokenizer(Lossy(), "/models/m", field="reward.model_path")
    assert str(error.value) == ("reward.model_path='/models/m': its tokenizer is broken: 'hello world 12' encodes to 2 "
                                "tokens that decode to '<unk><unk>'; give a model folder with its tokenizer files or a "
                                "hub name")
    # A model folder without tokenizer files loads as an empty vocabulary: refused when checked.
    shutil.copy(Path(model_path) / "config.json", tmp_path / "config.json")
    assert load_tokenizer(str(tmp_path))("hello")["input_ids"] == []
    with pytest.raises(ValueError, match=r"its tokenizer is broken: it encodes 'hello world 12' to no tokens"):
        load_tokenizer(str(tmp_path), check=True)


def test_check_model_source_wants_a_readable_config_when_asked(model_path, tmp_path):
    check_model_source(str(model_path), needs_config=True)
    check_model_source(str(tmp_path))  # a folder (e.g. a tokenizer's) is enough without needs_config
    with pytest.raises(ValueError) as error:
        check_model_source(str(tmp_path), field="critic.model_path", needs_config=True)
    assert str(error.value) == (f"critic.model_path={str(tmp_path)!r} has no config.json, so it is not a Hugging Face "
                                "model folder; give the folder from save_pretrained (or a hub name)")
    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(ValueError) as error:
        check_model_source(str(tmp_path), needs_config=True)
    assert str(error.value) == (f"model.path={str(tmp_path)!r}: {str(tmp_path / 'config.json')!r} is not valid JSON "
                                "(line 1, column 16: Expecting value); give the config.json save_pretrained writes")


def test_load_tokenizer_keeps_pad_token(model_path):
    tokenizer = load_tokenizer(str(model_path))
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id == 257
    assert tokenizer.eos_token_id == 256


def test_load_tokenizer_falls_back_to_eos_as_pad(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<|endoftext|>"
    assert loaded.pad_token_id == loaded.eos_token_id == 256


def test_load_causal_lm_defaults(model_path):
    model = load_causal_lm(str(model_path), device="cpu")
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert model.config._attn_implementation == "sdpa"
    assert model.config.hidden_size == 64
    assert model.config.num_hidden_layers == 1


def test_load_causal_lm_dtype_and_attention(model_path):
    model = load_causal_lm(str(model_path), dtype="bfloat16", device="cpu", attn_implementation="eager")
    assert all(parameter.dtype == torch.bfloat16 for parameter in model.parameters())
    assert model.config._attn_implementation == "eager"
    reference = load_causal_lm(str(model_path), device=torch.device("cpu"))
    torch.testing.assert_close(model.model.embed_tokens.weight.float(),
                               reference.model.embed_tokens.weight.to(torch.bfloat16).float())


def test_load_causal_lm_errors(model_path):
    with pytest.raises(ValueError, match=r"model\.compute_dtype"):
        load_causal_lm(str(model_path), dtype="float64", device="cpu")
    with pytest.raises(ValueError, match=r"model\.path"):
        load_causal_lm("./does-not-exist")
    with pytest.raises(ValueError, match="flash_attention_2"):
        load_causal_lm(str(model_path), device="cpu", attn_implementation="flash_attention_2")


def test_load_relative_local_folder(model_path, monkeypatch):
    monkeypatch.chdir(model_path.parent)
    model = load_causal_lm(model_path.name, device="cpu")
    assert model.config.hidden_size == 64
    assert load_tokenizer("./" + model_path.name).eos_token_id == 256


def test_load_pretrained_passes_extra_kwargs(model_path):
    from transformers import AutoModelForTokenClassification

    model = load_pretrained(AutoModelForTokenClassification, str(model_path), device="cpu", num_labels=1)
    assert model.config.num_labels == 1
    assert model.score.out_features == 1
    causal = load_causal_lm(str(model_path), device="cpu")
    torch.testing.assert_close(model.model.embed_tokens.weight, causal.model.embed_tokens.weight)


def test_compile_layers_compiles_every_block_and_keeps_the_outputs(tmp_path):
    from components.models import compile_layers

    path = build_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                                          intermediate_size=128, num_hidden_layers=3))
    model = load_causal_lm(str(path), device="cpu")
    input_ids = torch.tensor([[5, 9, 12, 40, 7]])
    with torch.no_grad():
        eager = model(input_ids=input_ids).logits
    # The eager backend runs Dynamo's tracing without a C++ toolchain; inductor is what runs on CUDA.
    assert compile_layers(model, backend="eager") == 3
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in model.model.layers)
    with torch.no_grad():
        compiled = model(input_ids=input_ids).logits
    torch.testing.assert_close(compiled, eager)
    assert set(model.state_dict()) == set(load_causal_lm(str(path), device="cpu").state_dict())  # saved as before


def test_optimizer_is_fused_only_on_cuda():
    from components.training import make_optimizer
    from components.training import OptimConfig

    optimizer, _ = make_optimizer(torch.nn.Linear(4, 4), OptimConfig())
    assert not optimizer.defaults.get("fused")
    if torch.cuda.is_available():
        optimizer, _ = make_optimizer(torch.nn.Linear(4, 4).cuda(), OptimConfig())
        assert optimizer.defaults["fused"] is True


def _copy_with_generation_eos(model_path, tmp_path, eos_token_id):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_path, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = eos_token_id
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_check_eos_returns_the_eos_ids_when_tokenizer_and_model_agree(model_path, tmp_path):
    from components.models import check_eos

    model_path = str(model_path)
    tokenizer = load_tokenizer(model_path)
    assert check_eos(tokenizer, model_path) == [tokenizer.eos_token_id]
    # An instruct model may declare several (end of turn, end of text): the tokenizer's first, then the others.
    listed = _copy_with_generation_eos(model_path, tmp_path, [7, tokenizer.eos_token_id])
    assert check_eos(tokenizer, listed) == [tokenizer.eos_token_id, 7]


def test_check_eos_refuses_a_tokenizer_eos_the_model_does_not_declare(model_path, tmp_path):
    from components.models import check_eos

    tokenizer = load_tokenizer(str(model_path))
    folder = _copy_with_generation_eos(model_path, tmp_path, 7)
    with pytest.raises(ValueError) as error:
        check_eos(tokenizer, folder)
    token = tokenizer.convert_ids_to_tokens(7)
    assert str(error.value) == (
        f"model.path={folder!r}: its tokenizer's eos is {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) but "
        f"its generation_config.json/config.json declare eos_token_id 7 ({token!r}); make them agree (eos_token in "
        "tokenizer_config.json, or eos_token_id in generation_config.json), e.g. rebuild the folder with "
        "`rlhf make-model`")
