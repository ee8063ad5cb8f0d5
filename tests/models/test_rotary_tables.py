"""Rotary turns read from tables of every position (a decode step's): the same bits as computing
them; no tables past the cap, for a model of unknown context, or for multimodal positions.
tests/sampling/test_rotary_tables_decode.py holds the sampler's decode steps to them."""

from __future__ import annotations

import pytest
import torch

from tinsmith.models import layers
from tinsmith.models.config import RopeConfig
from tinsmith.models.layers import Rotary

ROPES = [
    RopeConfig(),
    RopeConfig(theta=1e6),
    RopeConfig(kind="linear", factor=2.0),
    RopeConfig(kind="llama3", factor=8.0, original_max_position_embeddings=512),
    RopeConfig(kind="yarn", factor=4.0, original_max_position_embeddings=512),  # cos and sin scaled too
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r.kind + ("-1e6" if r.theta == 1e6 else ""))
@pytest.mark.parametrize("width", [8, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_give_the_computed_turns_bit_for_bit(rope, width, dtype):
    rotary = Rotary(width, rope, max_positions=4096)
    g = torch.Generator().manual_seed(width)
    for rows, length in ((1, 1), (64, 1), (256, 1), (3, 37)):  # decode steps, and a prefill's shape
        positions = torch.randint(0, 4096, (rows, length), generator=g)
        computed = rotary(positions, dtype)
        tabled = rotary(positions, dtype, tabled=True)
        for c, t in zip(computed, tabled):
            assert t.shape == c.shape == (rows, length, 1, width) and t.dtype == dtype and t.is_contiguous()
            assert torch.equal(t, c)
    assert list(rotary._tables) == [(torch.device("cpu"), dtype)]  # made once, kept


def test_no_tables_past_the_cap_or_without_a_context():
    long = Rotary(16, RopeConfig(), max_positions=layers.TABLE_MAX_POSITIONS + 1)
    unknown = Rotary(16, RopeConfig())
    positions = torch.tensor([[5]])
    for rotary in (long, unknown):
        assert torch.equal(rotary(positions, torch.float32, tabled=True)[0], rotary(positions, torch.float32)[0])
        assert rotary._tables == {}


def test_multimodal_positions_are_computed():
    """3-D (temporal, height, width) positions turn each frequency by its own axis: no table."""
    rotary = Rotary(24, RopeConfig(mrope_section=(4, 4, 4)), max_positions=256)
    positions = torch.stack([torch.arange(10), torch.arange(10) // 2, torch.arange(10) % 3])[:, None]
    assert torch.equal(rotary(positions, torch.float32, tabled=True)[1], rotary(positions, torch.float32)[1])
    assert rotary._tables == {}
