"""bench/verl/verl_bench_setup.py's read-outs of a verl run: the step times from verl's console lines (the warm-up
left out, a checkpoint's seconds taken out of the step that wrote it) and the weight comparison, by hand."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parent.parent / "bench" / "verl" / "verl_bench_setup.py"


@pytest.fixture(scope="module")
def setup():
    spec = importlib.util.spec_from_file_location("verl_bench_setup", SETUP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_leaves_out_the_warm_up_and_the_checkpoint(setup, tmp_path):
    log = tmp_path / "verl.log"
    log.write_text("\n".join([
        "(TaskRunner pid=1) some ray line",
        "(TaskRunner pid=1) step:1 - timing_s/step:172.8 - timing_s/gen:32.1 - actor/grad_norm:0.25",
        "(TaskRunner pid=1) step:2 - timing_s/step:60.0 - timing_s/gen:20.0 - timing_s/save_checkpoint:4.0",
        "(TaskRunner pid=1) step:3 - timing_s/step:50.0 - timing_s/gen:18.0 - actor/grad_norm:0.5",
    ]))
    out = tmp_path / "verl_bench.json"
    setup.summary(log, out, warmup=1)
    result = json.loads(out.read_text())
    assert result["step_s_all"] == [56.0, 50.0]
    assert result["step_s"] == pytest.approx(53.0)
    assert result["stage_s"]["gen"] == pytest.approx(19.0)
    assert result["stage_s"]["save_checkpoint"] == pytest.approx(4.0)
    assert result["gen_tokens_per_s"] == pytest.approx(64 * 8 * 512 / 53.0)


def test_compare_counts_changed_weights_into_the_summary(setup, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    initial, final = tmp_path / "initial", tmp_path / "final"
    initial.mkdir(), final.mkdir()
    save_file({"a": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)}, str(initial / "model.safetensors"))
    save_file({"a": torch.tensor([1.0, 2.0, 3.0, 6.0])}, str(final / "model.safetensors"))
    out = tmp_path / "verl_bench.json"
    out.write_text(json.dumps({"step_s": 53.0}))
    setup.compare(initial, final, out)
    result = json.loads(out.read_text())
    assert result["step_s"] == 53.0  # the summary kept
    assert result["weights_changed_fraction"] == pytest.approx(0.25)
    # RMS(dw) / RMS(w0) = sqrt(2**2 / (1 + 4 + 9 + 16))
    assert result["weights_rms_ratio"] == pytest.approx((4 / 30) ** 0.5)
    assert result["weights_final_dtypes"] == ["F32"]  # as safetensors spells it, as the product's rows do
    assert result["weights_changed_elements"] == 1 and result["weights_compared_elements"] == 4
