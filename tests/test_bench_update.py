"""bench/update.py's batches and its CPU run: the fixed batch is full length; `--natural` gives each update a new
batch of real lengths 1 .. the given tokens (what made the compiled blocks compile again on a GPU), and the run
reports each update's graphs compiled, with no MFU (its FLOPs count assumes full lengths)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench.update import synthetic_batch

ROOT = Path(__file__).resolve().parent.parent


def test_natural_batches_have_real_lengths_from_one_to_the_given_tokens_and_differ_by_seed():
    fixed, _, _ = synthetic_batch(64, 6, 5, vocab=100)
    assert fixed.attention_mask.all() and fixed.input_ids.shape == (64, 11)
    batch, advantages, engine = synthetic_batch(64, 6, 5, vocab=100, seed=1, natural=True)
    prompt_lengths = batch.attention_mask[:, :batch.prompt_length].sum(1)
    response_lengths = batch.response_mask.sum(1)
    assert prompt_lengths.min() == 1 and prompt_lengths.max() == 6  # 64 draws of 1..6 cover both ends
    assert response_lengths.min() == 1 and response_lengths.max() == 5
    assert (advantages[batch.response_mask == 0] == 0).all() and engine.shape == batch.response_mask.shape
    other, _, _ = synthetic_batch(64, 6, 5, vocab=100, seed=2, natural=True)
    assert not torch.equal(other.response_mask.sum(1), response_lengths)


def test_a_natural_run_reports_each_updates_graphs_and_no_mfu(tmp_path):
    out = tmp_path / "update.json"
    subprocess.run([sys.executable, "bench/update.py", "--device", "cpu", "--preset", "tiny", "--model-dir",
                    str(tmp_path / "model"), "--samples", "16", "--prompt-tokens", "6", "--response-tokens", "5",
                    "--micro-batch", "4", "--steps", "2", "--natural", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["graphs_per_update"] == [0, 0, 0]  # the CPU compiles nothing (model.compile is CUDA only)
    assert len(result["update_s_all"]) == 3 and result["update_mfu"] is None and result["update_tflops"] is None
