"""The loss's softmax kernels: each row's log-sum-exp and the logits' gradient as torch computes
them from fp32 logits, over vocabularies of one and many blocks; and the chunked target logprobs
through them give the torch path's values and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import assert_builds_for_hopper, kernel_device
from tests.models.test_chunked_logprobs import N, SEGMENTS, _head, _rel, _targets
from tinsmith.kernels import vocab_softmax
from tinsmith.models.chunked_logprobs import UnembedLora, chunked_target_logprobs, targets_to_elements


@pytest.fixture(autouse=True)
def kernel_for_every_tensor(monkeypatch):
    monkeypatch.setattr(vocab_softmax, "BACKEND", "triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,block", [(1000, 4096), (5000, 1024), (1537, 256)])
def test_row_logsumexp_is_torchs_over_the_fp32_values(dtype, vocab, block, monkeypatch):
    device = kernel_device(runtime_loop_bounds=True)
    monkeypatch.setattr(vocab_softmax, "BLOCK", block)
    logits = (torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 4).to(device, dtype)
    logits[2, 5] = 60.0  # one entry far above the rest: the running maximum must rescale the sum
    lse = vocab_softmax.row_logsumexp(logits)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("vocab,block", [(1000, 4096), (1537, 256)])
def test_softmax_grad_is_the_fp32_gradient_rounded_once(vocab, block, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(vocab_softmax, "BLOCK", block)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(7, vocab, generator=g) * 3).to(device, torch.bfloat16)
    g_row = torch.randn(7, generator=g).to(device)
    target = torch.randint(0, vocab, (7,), generator=g).to(device)
    target[3] = -1  # a row without a target
    g_row[3] = 0.0
    lse = torch.logsumexp(logits.float(), -1)
    want = (logits.float() - lse[:, None]).exp() * -g_row[:, None]
    has = target >= 0
    want[has.nonzero().squeeze(1), target[has]] += g_row[has]
    got = vocab_softmax.softmax_grad_(logits.clone(), lse, g_row, target)
    assert got.dtype == torch.bfloat16
    # the same fp32 value rounded once (exp's last bits may differ, and Triton's interpreter
    # truncates: at most one bf16 step)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=8e-3, atol=1e-6)
    out = torch.empty_like(logits)
    vocab_softmax.softmax_grad_(logits, lse, g_row, target, out=out)
    assert torch.equal(out, got)  # into another buffer, the logits kept


def _grads(head, h, rows, cols, g_out, chunk_rows, backend, monkeypatch):
    monkeypatch.setattr(vocab_softmax, "BACKEND", backend)
    for p in [head.weight, *(t for w in head.adapters.values() for t in (w.A, w.B))]:
        p.grad = None
    x = h.detach().clone().requires_grad_()
    loras = [UnembedLora(w.A, w.B, w.scale, a, b) for slot, a, b in SEGMENTS
             if slot is not None and (w := head.adapters.get(slot)) is not None]
    one_per_row = bool((rows[1:] > rows[:-1]).all())
    lp = chunked_target_logprobs(x, head.weight, rows, cols, loras=loras, chunk_rows=chunk_rows, rows_host=rows.cpu(),
                                 one_per_row=one_per_row)
    (lp * g_out).sum().backward()
    grads = {"hidden": x.grad, "weight": head.weight.grad}
    for slot, w in head.adapters.items():
        grads[f"A{slot}"], grads[f"B{slot}"] = w.A.grad, w.B.grad
    return lp.detach(), grads


@pytest.mark.parametrize("two_d", [False, True])  # one target a row (fused backward) / three (torch's)
@pytest.mark.parametrize("chunk_rows", [7, 4 * N])  # logits recomputed in backward / kept from forward
def test_chunked_logprobs_through_the_kernels_match_torch(two_d, chunk_rows, monkeypatch):
    device = kernel_device(runtime_loop_bounds=True)
    head = _head(torch.bfloat16, train_weight=True).to(device)
    for w in head.adapters.values():
        w.A.data, w.B.data = w.A.data.to(device), w.B.data.to(device)
    h = torch.tanh(torch.randn(N, head.in_features, generator=torch.Generator().manual_seed(3))).to(device,
                                                                                                   torch.bfloat16)
    rows, cols = targets_to_elements(_targets(two_d).to(device))
    g_out = torch.randn(rows.shape[0], generator=torch.Generator().manual_seed(4)).to(device)
    ref, ref_g = _grads(head, h, rows, cols, g_out, chunk_rows, "torch", monkeypatch)
    calls = {"lse": 0, "grad": 0}
    real_lse, real_grad = vocab_softmax.row_logsumexp, vocab_softmax.softmax_grad_
    monkeypatch.setattr(vocab_softmax, "row_logsumexp", lambda *a: calls.__setitem__("lse", calls["lse"] + 1)
                        or real_lse(*a))
    monkeypatch.setattr(vocab_softmax, "softmax_grad_", lambda *a, **k: calls.__setitem__("grad", calls["grad"] + 1)
                        or real_grad(*a, **k))
    out, got_g = _grads(head, h, rows, cols, g_out, chunk_rows, "triton", monkeypatch)
    chunks = -(-N // chunk_rows)
    assert calls == {"lse": chunks, "grad": 0 if two_d else chunks}
    assert _rel(out, ref) < 1e-5
    # Triton's interpreter truncates fp32 to bf16 where GPUs round to nearest: a one-step bias of
    # the logits' gradient there (the GPU tier holds the same comparison to 5e-3).
    tol = 1.5e-2 if device == "cpu" else 5e-3
    for name, g in ref_g.items():
        assert got_g[name] is not None and got_g[name].dtype == g.dtype, name
        assert _rel(got_g[name], g) < tol, name


_COMPILE = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tinsmith.kernels import vocab_softmax

for dt in sys.argv[1:]:
    sig = {"logits_ptr": f"*{dt}", "lse_ptr": "*fp32", "vocab": "i32", "stride_row": "i64", "BLOCK": "constexpr"}
    src = ASTSource(fn=vocab_softmax._lse_kernel, signature=sig, constexprs={"BLOCK": 4096})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
    sig = {"logits_ptr": f"*{dt}", "lse_ptr": "*fp32", "g_ptr": "*fp32", "target_ptr": "*i64", "out_ptr": f"*{dt}",
           "vocab": "i32", "stride_row": "i64", "stride_out": "i64", "BLOCK": "constexpr"}
    src = ASTSource(fn=vocab_softmax._grad_kernel, signature=sig, constexprs={"BLOCK": 4096})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
'''


def test_kernels_compile_for_hopper(tmp_path):
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp16")
