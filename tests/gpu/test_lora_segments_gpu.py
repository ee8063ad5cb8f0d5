"""The segmented LoRA kernels (rows sharing an adapter read it once) compiled on the GPU: at the
Qwen3-1.7B shape's sizes they equal the gathered kernels, repeat bit for bit when replayed from a
CUDA graph; and decode replayed from graphs with them samples what it samples with the gathered
ones (fp32: the same tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import SMALL
from tests.gpu.conftest import DEVICE
from tests.gpu.test_decode_graphs_gpu import _sample
from tests.sampling.conftest import random_adapter
from tinsmith.devtools.tiny_model import make_tiny_model
from tinsmith.kernels import lora_gather as lg
from tinsmith.kernels import lora_segments as ls
from tinsmith.models.loading import load_model

pytestmark = pytest.mark.gpu


def _cuda() -> None:
    if torch.device(DEVICE).type != "cuda" or not lg.triton_available():
        pytest.skip("the segmented kernels need CUDA and triton")


@pytest.mark.parametrize("k, outs", [(2048, (2048, 1024, 1024)), (6144, (2048,)), (2048, (6144, 6144))])
def test_kernels_equal_the_gathered_ones_and_replay_bit_for_bit(k, outs):
    _cuda()
    g = torch.Generator().manual_seed(k)
    rows, adapters, rank = 64, 8, 32
    parts = len(outs)
    A = (torch.randn(adapters, parts * rank, k, generator=g) / k**0.5).to(DEVICE, torch.bfloat16)
    B = (torch.randn(adapters, sum(outs), rank, generator=g) * 0.01).to(DEVICE, torch.bfloat16)
    columns, start = [], 0
    for o in outs:
        columns.append((start, start + o))
        start += o
    offsets = torch.cat([torch.full((b - a,), j * rank, dtype=torch.int32) for j, (a, b) in enumerate(columns)])
    offsets = offsets.to(DEVICE) if parts > 1 else None
    positions = [(i % (adapters + 1)) - 1 for i in range(rows)]  # base rows among them
    idx = torch.tensor(positions, device=DEVICE)
    tiles = ls.row_tiles(positions, torch.device(DEVICE))
    block = ls.expand_block(sum(outs), columns if parts > 1 else None)
    x = torch.randn(rows, k, generator=g).to(DEVICE, torch.bfloat16)
    base = torch.randn(rows, sum(outs), generator=g).to(DEVICE, torch.bfloat16)
    want = base.clone()
    lg.expand_triton(want, lg.shrink_triton(x, A, idx), B, idx, offsets)
    y = base.clone()
    graph = torch.cuda.CUDAGraph()
    ls.expand(y, ls.shrink(x, A, tiles), B, tiles, offsets, block)  # compiles outside the capture
    first = y.clone()
    with torch.cuda.graph(graph):
        y.copy_(base)
        ls.expand(y, ls.shrink(x, A, tiles), B, tiles, offsets, block)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, first)
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(y[idx < 0], base[idx < 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_samples_the_same_by_tiles_as_by_rows(dtype, tmp_path, monkeypatch):
    _cuda()
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", SMALL, seed=1)
    rounds = [([1, None, 2, 3, 1, 1, None, 2], None)]
    got = {}
    for segmented in (False, True):
        monkeypatch.setattr(ls, "ENABLED", segmented)
        model = load_model(str(model_dir), device=DEVICE, dtype=dtype).model
        for slot, rank in ((1, 4), (2, 8), (3, 16)):
            random_adapter(model, slot, rank=rank, seed=slot)
        got[segmented], sampler = _sample(model, "graphs", rounds)
        assert sampler.stats["graph_replays"] > 0, sampler.stats
    assert ls.GUARD.failed is None
    for key, ref in got[False][0].items():
        for a, b in zip(ref.sequences, got[True][0][key].sequences):
            if dtype == torch.float32:
                assert a.tokens.tolist() == b.tokens.tolist(), key
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
            else:  # other sums in bf16 may turn a sampled token; the rows still finish
                assert len(b.tokens) > 0
