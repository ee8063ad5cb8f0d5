"""Chunked target logprobs against the plain path (full logits from ``LoraLinear``, then
log-softmax): values and gradients of hidden states, unembedding and its LoRA factors, for 1-D
and 2-D targets, tied and untied embeddings, fp32 and bf16; and the memory it saves."""

from __future__ import annotations

import functools

import pytest
import torch

from tinsmith.devtools.memory import PeakTensorMemory
from tinsmith.models.chunked_logprobs import (
    UnembedLora, chunked_target_logprobs, rows_per_chunk, targets_to_elements,
)
from tinsmith.models.lora import LoraLinear

N, H, V = 29, 24, 301
SEGMENTS = [(0, 0, 11), (None, 11, 15), (1, 15, N)]  # adapter 0, base rows, adapter 1


def plain_target_logprobs(head: LoraLinear, h, segs, rows, cols):
    """The reference: the whole (N, V) fp32 logits, as the model's ``logits`` makes them."""
    logits = head(h, segs).float()
    return logits[rows, cols] - torch.logsumexp(logits, dim=-1)[rows]


def _head(dtype, train_weight: bool) -> LoraLinear:
    g = torch.Generator().manual_seed(0)
    head = LoraLinear(H, V)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    head.weight.data = head.weight.data.to(dtype)
    head.weight.requires_grad_(train_weight)
    for slot, rank in ((0, 4), (1, 2)):
        w = head.add_adapter(slot, rank, alpha=8.0, generator=g)
        with torch.no_grad():
            w.B.copy_(torch.randn(V, rank, generator=g) * 0.1)
    return head


def _targets(two_d: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if not two_d:
        return torch.randint(0, V, (N,), generator=g)
    t = torch.randint(0, V, (N, 3), generator=g)
    t[:, 2] = t[:, 0]  # a repeated candidate: its gradient must count twice
    return t


def _run(fn, head, tokens, embed, tied, rows, cols, g_out):
    """Hidden states from an embedding (the unembedding itself when tied) through a nonlinearity,
    so gradients reach the weight from both sides; returns logprobs and every gradient."""
    for p in [head.weight, embed, *(t for w in head.adapters.values() for t in (w.A, w.B))]:
        p.grad = None
    table = head.weight if tied else embed
    h = torch.tanh(table[tokens].float() * 1.5).to(head.weight.dtype)
    lp = fn(head, h, rows, cols)
    (lp * g_out).sum().backward()
    grads = {"weight": head.weight.grad, "embed": embed.grad}
    for slot, w in head.adapters.items():
        grads[f"A{slot}"], grads[f"B{slot}"] = w.A.grad, w.B.grad
    return lp.detach(), grads


def _plain(head, h, rows, cols):
    return plain_target_logprobs(head, h, SEGMENTS, rows, cols)


def _chunked(head, h, rows, cols, chunk_rows=7):
    loras = [UnembedLora(w.A, w.B, w.scale, a, b) for slot, a, b in SEGMENTS
             if slot is not None and (w := head.adapters.get(slot)) is not None]
    return chunked_target_logprobs(h, head.weight, rows, cols, loras=loras, chunk_rows=chunk_rows)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_rows", [7, 4 * N])  # logits recomputed in backward / kept from forward
def test_values_and_gradients_match_plain_path(dtype, tol, two_d, tied, chunk_rows):
    head = _head(dtype, train_weight=True)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    rows, cols = targets_to_elements(_targets(two_d))
    g_out = torch.randn(rows.shape[0], generator=torch.Generator().manual_seed(4))
    ref, ref_g = _run(_plain, head, tokens, embed, tied, rows, cols, g_out)
    chunked = functools.partial(_chunked, chunk_rows=chunk_rows)
    out, got_g = _run(chunked, head, tokens, embed, tied, rows, cols, g_out)
    assert out.dtype == torch.float32
    assert _rel(out, ref) < tol
    for name, g in ref_g.items():
        if g is None:  # the embedding is unused when tied
            assert got_g[name] is None, name
            continue
        assert got_g[name] is not None and got_g[name].dtype == g.dtype, name
        assert _rel(got_g[name], g) < tol, name


def test_frozen_weight_and_frozen_hidden_get_no_gradient():
    head = _head(torch.float32, train_weight=False)
    h = torch.randn(N, H)  # no grad wanted: only the adapters train
    rows, cols = targets_to_elements(_targets(False))
    lp = _chunked(head, h, rows, cols)
    lp.sum().backward()
    assert head.weight.grad is None and h.grad is None
    assert all(w.A.grad is not None and w.B.grad is not None for w in head.adapters.values())


def test_chunk_size_does_not_change_results():
    head = _head(torch.float32, train_weight=False)
    h = torch.randn(N, H)
    rows, cols = targets_to_elements(_targets(True))
    loras = [UnembedLora(head.adapters[s].A, head.adapters[s].B, head.adapters[s].scale, a, b)
             for s, a, b in SEGMENTS if s is not None]
    outs = [chunked_target_logprobs(h, head.weight, rows, cols, loras=loras, chunk_rows=c) for c in (1, 5, N, 10 * N)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-6, atol=1e-6)


def test_rows_per_chunk_follows_the_memory_budget():
    assert rows_per_chunk(151_936) == (256 << 20) // (4 * 151_936)
    assert rows_per_chunk(1000, chunk_bytes=4000 * 3) == 3
    assert rows_per_chunk(10**9, chunk_bytes=1) == 1


def _peak_forward_backward(fn, n, h_dim, vocab) -> int:
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(vocab, h_dim, generator=g) * 0.05).requires_grad_()
    hidden = torch.randn(n, h_dim, generator=g).requires_grad_()
    rows, cols = targets_to_elements(torch.randint(0, vocab, (n,), generator=g))
    with PeakTensorMemory() as mem:
        fn(hidden, weight, rows, cols).sum().backward()
    return mem.peak_bytes


def test_peak_memory_stays_far_below_full_logits():
    n, h_dim, vocab = 4096, 16, 32_000
    full_logits = n * vocab * 4  # 500 MiB

    def plain(h, w, rows, cols):
        logits = (h @ w.t()).float()
        return logits[rows, cols] - torch.logsumexp(logits, -1)[rows]

    def chunked(h, w, rows, cols):
        return chunked_target_logprobs(h, w, rows, cols, chunk_rows=256)  # 32 MiB of logits a chunk

    # The meter sees the plain path's full logits (so it can fail; a quarter of the rows keeps it quick)...
    assert _peak_forward_backward(plain, n // 4, h_dim, vocab) >= full_logits // 4
    # ...and the chunked path holds a few chunks, the weight's gradient and the inputs' sizes.
    peak = _peak_forward_backward(chunked, n, h_dim, vocab)
    assert peak < full_logits / 4, f"peak {peak / 2**20:.0f} MiB"
