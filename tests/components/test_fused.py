"""Fused label log-probs and entropy (components.algorithms.fused) against hand values and the plain
PyTorch expression: the Triton kernels run in Triton's interpreter on the CPU and compiled on CUDA."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.algorithms.fused import logprobs_and_entropy, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def test_unfused_matches_hand_computed_values():
    probabilities = torch.tensor([0.1, 0.2, 0.3, 0.4])
    # Position 0 predicts label 3, position 1 predicts label 0; position 2 (past the labels) is ignored.
    logits = probabilities.log().repeat(1, 3, 1)
    labels = torch.tensor([[3, 0]])
    logprobs, entropy = logprobs_and_entropy(logits, labels, 1.0, fused=False)
    expected_entropy = -sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4))  # 1.2799
    assert logprobs[0].tolist() == pytest.approx([math.log(0.4), math.log(0.1)], abs=1e-6)
    assert entropy[0].tolist() == pytest.approx([expected_entropy] * 2, abs=1e-6)
    # Temperature 0.5 doubles the logits: softmax proportional to p^2 = (1, 4, 9, 16) / 30.
    logprobs, entropy = logprobs_and_entropy(logits, labels, 0.5, fused=False)
    squared = [1 / 30, 4 / 30, 9 / 30, 16 / 30]
    assert logprobs[0].tolist() == pytest.approx([math.log(16 / 30), math.log(1 / 30)], abs=1e-6)
    assert entropy[0, 0].item() == pytest.approx(-sum(q * math.log(q) for q in squared), abs=1e-6)


def test_rejects_logits_that_do_not_cover_the_labels():
    with pytest.raises(ValueError, match="do not cover"):
        logprobs_and_entropy(torch.zeros(1, 2, 5), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), 0.0)


def _compare(logits, labels, temperature, entropy_grad, *, atol, grad_atol, grad_rtol=0.0):
    """Fused and unfused values and gradients of sum(g1 * logprobs) (+ sum(g2 * entropy))."""
    generator = torch.Generator().manual_seed(1)
    g1 = torch.randn(labels.shape, generator=generator).to(logits.device)
    g2 = torch.randn(labels.shape, generator=generator).to(logits.device)
    results = []
    for fused in (True, False):
        leaf = logits.detach().clone().requires_grad_()
        logprobs, entropy = logprobs_and_entropy(leaf, labels, temperature, entropy_grad=entropy_grad, fused=fused)
        assert entropy.requires_grad == entropy_grad
        loss = (logprobs * g1).sum() + ((entropy * g2).sum() if entropy_grad else 0.0)
        loss.backward()
        results.append((logprobs.detach(), entropy.detach(), leaf.grad))
    (lp, ent, grad), (lp_ref, ent_ref, grad_ref) = results
    torch.testing.assert_close(lp, lp_ref, atol=atol, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=atol, rtol=0)
    torch.testing.assert_close(grad.float(), grad_ref.float(), atol=grad_atol, rtol=grad_rtol)
    assert grad.dtype == logits.dtype
    # Positions past the labels get no gradient.
    assert float(grad[:, labels.shape[1]:].abs().max()) == 0.0
    return results


def _interpreted_case(vocab: int, temperature: float, entropy_grad: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, vocab, generator=generator) * 3  # several 4096-wide blocks for vocab 9000
    labels = torch.randint(0, vocab, (2, 3), generator=generator)
    # The entropy's gradient uses x - E_p[x] with E_p[x] = lse - H: for a peaked row (lse ~ 20) float32
    # rounding of that difference reaches ~3e-5 (seen: 2.9e-5 against float64 with numpy 2.3's exp in
    # Triton 3.9's interpreter), so that case gets 5e-5; the log-prob gradient alone stays at 2e-5.
    grad_atol = 5e-5 if entropy_grad else 2e-5
    (_, _, grad), _ = _compare(logits, labels, temperature, entropy_grad, atol=1e-4, grad_atol=grad_atol)
    # The gradient of sum(g1 * logprob) over one row sums to 0 (onehot - softmax sums to 0).
    if not entropy_grad:
        assert float(grad.sum(-1).abs().max()) < 1e-5
    print("compared")


@needs_triton
@pytest.mark.skipif(triton_available() and _triton_version() < (3, 9),
                    reason="older Triton interpreters cannot loop to a bound passed as a kernel argument")
@pytest.mark.parametrize("vocab,temperature,entropy_grad", [(1000, 1.0, False), (9000, 0.7, False), (9000, 0.7, True)])
def test_interpreted_kernels_match_pytorch(vocab, temperature, entropy_grad):
    # The Triton kernels, run by Triton's interpreter on the CPU. It must be on before triton.language
    # is first imported, hence a fresh process.
    root = Path(__file__).resolve().parents[2]
    code = f"from tests.components.test_fused import _interpreted_case; _interpreted_case({vocab}, {temperature}, {entropy_grad})"
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0 and "compared" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
def test_compiled_kernels_match_pytorch_in_bf16_on_cuda():
    """A Qwen2.5-sized vocabulary in bf16, as the actor's update sees it."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 65, 151936, generator=generator) * 4).to("cuda", torch.bfloat16)
    labels = torch.randint(0, 151936, (2, 64), generator=generator).cuda()
    # Gradients are stored in bf16 by both paths: equal up to one bf16 rounding step (2^-7 relative).
    _compare(logits, labels, 0.8, False, atol=1e-4, grad_atol=1e-4, grad_rtol=2**-7)
    _compare(logits, labels, 1.0, True, atol=1e-4, grad_atol=1e-4, grad_rtol=2**-7)
