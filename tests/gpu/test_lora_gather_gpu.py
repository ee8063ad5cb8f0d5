"""The gathered shrink's partials added up by its last program, on a GPU where the programs of a
row really finish in any order: at a 1.7B layer's shapes, eagerly many times and replayed from a
CUDA graph, the sum equals the partials added in split order bit for bit, and the tickets are
back at zero after every call."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICE
from tests.gpu.helpers import assert_repeats_bit_for_bit
from tinsmith.kernels import lora_gather as lg

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
    assert_repeats_bit_for_bit(lambda: lg.shrink_triton(x, A, idx), want, eager=200, captured=20, replays=10)
