"""The gathered shrink's partials added up by its last program, on a GPU where the programs of a
row really finish in any order: at a 1.7B layer's shapes, eagerly many times and replayed from a
CUDA graph, the sum equals the partials added in split order bit for bit, and the tickets are
back at zero after every call."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tinsmith.kernels import lora_gather as lg
from tinsmith.kernels import tickets

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows, k, parts", [(64, 2048, 3), (64, 6144, 1), (256, 6144, 1), (8, 2048, 2)])
def test_the_last_program_sums_in_split_order_under_concurrency(rows, k, parts):
    if torch.device(DEVICE).type != "cuda" or not lg.triton_available():
        pytest.skip("the gathered kernels need CUDA and triton")
    g = torch.Generator().manual_seed(rows + k)
    adapters, rank = 8, 32
    A = (torch.randn(adapters, parts * rank, k, generator=g) / k**0.5).to(DEVICE, torch.bfloat16)
    idx = torch.tensor([(i % (adapters + 1)) - 1 for i in range(rows)], device=DEVICE)  # base rows among them
    x = torch.randn(rows, k, generator=g).to(DEVICE, torch.bfloat16)
    partials = lg.shrink_partials_triton(x, A, idx)
    if partials.shape[1] == 1:
        pytest.skip(f"{rows} rows of {k} inputs do not split")
    want = partials[:, 0].clone()
    for s in range(1, partials.shape[1]):
        want += partials[:, s]
    assert lg._shrink_launch(x, A, idx, None, summed=True)[1] is not None
    for _ in range(200):
        assert torch.equal(lg.shrink_triton(x, A, idx), want)
    assert not tickets.counters(x.device).any()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lg.shrink_triton(x, A, idx)  # warm on a side stream, as the sampler's first step
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = torch.stack([lg.shrink_triton(x, A, idx) for _ in range(20)])
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want.expand(20, *want.shape))
    assert not tickets.counters(x.device).any()
