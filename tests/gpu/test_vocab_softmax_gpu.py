"""The loss's softmax kernels on the GPU: chunked target logprobs over a 151,936-entry
vocabulary in bf16 (LoRA on the unembedding, chunks recomputed in backward and one kept) give
the torch path's values and gradients, rounded to nearest as torch rounds."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.kernels.support import skip_if_interpreter_cannot_loop_to_runtime_bounds
from tests.kernels.test_vocab_softmax import _grads
from tests.models.test_chunked_logprobs import _rel
from tinsmith.kernels import lora_gather, vocab_softmax
from tinsmith.models.chunked_logprobs import targets_to_elements
from tinsmith.models.lora import LoraLinear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chunk_rows", [96, 1024])  # recomputed in backward / kept from forward
def test_chunked_logprobs_through_the_kernels_match_torch_on_a_real_vocabulary(chunk_rows, monkeypatch):
    device = torch.device(DEVICE)
    if device.type == "cuda" and vocab_softmax.triton is None:
        pytest.skip("triton is not installed (pip install 'tinsmith[gpu]')")
    if device.type == "cpu" and not lora_gather.triton_interpreting():
        pytest.skip("on a CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
    skip_if_interpreter_cannot_loop_to_runtime_bounds()
    n, hidden, vocab = (512, 256, 151_936) if device.type == "cuda" else (40, 32, 5000)
    g = torch.Generator().manual_seed(0)
    head = LoraLinear(hidden, vocab)
    head.weight.data = (torch.randn(vocab, hidden, generator=g) * 0.2).to(torch.bfloat16)
    head.weight.requires_grad_(True)
    for slot in (0, 1):
        w = head.add_adapter(slot, 8, 16.0, generator=g)
        with torch.no_grad():
            w.B.copy_(torch.randn(vocab, 8, generator=g) * 0.05)
    head.to(device)
    for w in head.adapters.values():
        w.A.data, w.B.data = w.A.data.to(device), w.B.data.to(device)
    h = torch.tanh(torch.randn(n, hidden, generator=g)).to(device, torch.bfloat16)
    rows, cols = targets_to_elements(torch.randint(0, vocab, (n,), generator=g).to(device))
    g_out = torch.randn(n, generator=g).to(device)
    segments = [(0, 0, n // 2), (None, n // 2, n // 2 + 8), (1, n // 2 + 8, n)]
    monkeypatch.setattr("tests.kernels.test_vocab_softmax.SEGMENTS", segments)
    ref, ref_g = _grads(head, h, rows, cols, g_out, chunk_rows, "torch", monkeypatch)
    out, got_g = _grads(head, h, rows, cols, g_out, chunk_rows, "triton", monkeypatch)
    assert vocab_softmax.GUARD.failed is None
    assert _rel(out, ref) < 1e-5
    tol = 5e-3 if device.type == "cuda" else 1.5e-2  # the interpreter truncates to bf16
    for name, want in ref_g.items():
        assert _rel(got_g[name], want) < tol, name
