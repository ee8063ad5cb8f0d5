"""The token-choice kernel picks the tokens the torch path picks (greedy rows, tempered draws by
inverse CDF, over vocabularies of one and many blocks, fp32 and bf16 logits) with the model's own
logprobs, and a sampler through it samples what one through torch samples."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.support import BUILD_PRELUDE, assert_builds_for_hopper, kernel_device
from tinsmith.kernels import token_draw
from tinsmith.sampling import logits as token_choice
from tinsmith.sampling.logits import KeyedUniforms, RowKinds, choose_tokens_masked, keyed_uniforms, uniforms


@pytest.fixture(autouse=True)
def kernel_for_every_tensor(monkeypatch):
    monkeypatch.setattr(token_draw, "BACKEND", "triton")


def torch_choice(logits, temperature, u, all_greedy=False):
    monkey = token_draw.BACKEND
    token_draw.BACKEND = "torch"
    try:
        zeros = torch.zeros_like(temperature, dtype=torch.long)
        tok, lp, _ = choose_tokens_masked(logits, temperature, zeros, torch.ones_like(temperature), u, None, all_greedy)
    finally:
        token_draw.BACKEND = monkey
    return tok, lp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,block", [(1000, 4096), (5000, 1024), (1537, 256)])
def test_the_kernel_picks_the_torch_paths_tokens(dtype, vocab, block, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(token_draw, "BLOCK", block)
    g = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device, dtype)
    logits[3, 17] = logits[3, 900 % vocab] = logits[3].max() + 1  # a tie: the first largest, as argmax
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1e-30, 1.0, 0.5, 2.0, 1.0, 0.9, 1.0], device=device)
    u = uniforms(torch.arange(rows, device=device) * 7919, torch.zeros(rows, dtype=torch.long, device=device),
                 torch.full((rows,), 3, device=device))
    tok, lp = token_draw.draw(logits, temperature, u)
    want_tok, want_lp = torch_choice(logits, temperature, u)
    assert tok.dtype == torch.long and lp.dtype == torch.float32
    assert tok.tolist() == want_tok.tolist()
    assert tok[3].item() == 17
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)


def test_all_greedy_rows_skip_the_draw():
    device = kernel_device()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 3000, generator=g).to(device)
    t = torch.zeros(5, device=device)
    tok, lp = token_draw.draw(logits, t, torch.rand(5, dtype=torch.float64, generator=g).to(device), all_greedy=True)
    assert tok.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])


def test_draws_follow_the_inverse_cdf():
    """Many uniforms against one row: each draw is the first token whose cumulative (tempered)
    probability reaches the uniform, as the flat float64 search finds it."""
    device = kernel_device()
    g = torch.Generator().manual_seed(2)
    vocab, n = 300, 200
    logits = (torch.randn(1, vocab, generator=g) * 2).expand(n, vocab).contiguous().to(device)
    u = torch.rand(n, dtype=torch.float64, generator=g).to(device)
    t = torch.full((n,), 0.8, device=device)
    tok, _ = token_draw.draw(logits, t, u)
    probs = torch.softmax(logits[0].double().cpu() / 0.8, -1)
    want = torch.searchsorted(probs.cumsum(0), u.cpu() * probs.sum())
    assert (tok.cpu() == want).float().mean() > 0.995  # all but a draw within rounding of a boundary


def test_choice_functions_take_the_kernel_where_it_applies(monkeypatch):
    """No truncating row and no top-k logprobs asked: the kernel; otherwise torch."""
    device = kernel_device()
    calls = []
    real = token_draw.draw
    monkeypatch.setattr(token_draw, "draw", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    logits = torch.randn(3, 800, generator=torch.Generator().manual_seed(3)).to(device)
    t = torch.tensor([1.0, 0.0, 0.6], device=device)
    k, p = torch.zeros(3, dtype=torch.long, device=device), torch.ones(3, device=device)
    u = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(device)
    want = torch_choice(logits, t, u)
    tok, lp, best = choose_tokens_masked(logits, t, k, p, u, None, False)
    assert len(calls) == 1 and best is None and tok.tolist() == want[0].tolist()
    choose_tokens_masked(logits, t, k, p, u, None, False, top=5)  # top-k logprobs: torch
    choose_tokens_masked(logits, t, k, p, u, torch.tensor([False, False, True], device=device), False)
    assert len(calls) == 1
    kinds = RowKinds.of(t.tolist(), k.tolist(), p.tolist(), 800, logits.device)
    tok, lp, full = token_choice.choose_tokens(logits, t, k, p, u, kinds, need_full=False)
    assert len(calls) == 2 and full is None and tok.tolist() == want[0].tolist()
    _, _, full = token_choice.choose_tokens(logits, t, k, p, u, kinds)  # the full logprobs asked for: torch
    assert len(calls) == 2 and full.shape == logits.shape


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_choice_writes_into_buffers_it_is_given(backend, monkeypatch):
    """A decode step's own buffers take the tokens and logprobs (the kernel writes them, torch
    copies them in); the values are the ones returned without buffers."""
    device = kernel_device()
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 2000, generator=g) * 2).to(device)
    t = torch.tensor([1.0, 0.0, 0.6, 1.2, 0.0, 1.0], device=device)
    k, p = torch.zeros(6, dtype=torch.long, device=device), torch.ones(6, device=device)
    u = torch.rand(6, dtype=torch.float64, generator=g).to(device)
    monkeypatch.setattr(token_draw, "BACKEND", backend)
    want_tok, want_lp, _ = choose_tokens_masked(logits, t, k, p, u, None, False)
    tokens, logprobs = torch.full((6,), -1, dtype=torch.long, device=device), torch.zeros(6, device=device)
    tok, lp, best = choose_tokens_masked(logits, t, k, p, u, None, False, out=(tokens, logprobs))
    assert tok is tokens and lp is logprobs and best is None
    assert tokens.tolist() == want_tok.tolist()
    assert torch.equal(logprobs, want_lp)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_sampler_through_the_kernel_samples_what_torch_samples(family, model_dirs, monkeypatch):
    import numpy as np

    from tests.sampling.conftest import fresh_model, make_sampler, run, task

    device = kernel_device()
    if device != "cpu":
        pytest.skip("the GPU tier compares the sampler's paths on a GPU")
    prompts = [np.random.default_rng(i).integers(4, 400, 12 + 5 * i).tolist() for i in range(3)]
    calls = []
    real = token_draw.draw
    monkeypatch.setattr(token_draw, "draw", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(token_draw, "BACKEND", backend)
        sampler = make_sampler(fresh_model(model_dirs[family]), model_dirs[family])
        results[backend] = run(sampler, [task(f"p{i}", p, max_tokens=6, temperature=t, seed=i, stop=[])
                                         for i, (p, t) in enumerate(zip(prompts, (1.0, 0.0, 0.7)))])
    assert calls  # the decode steps went through the kernel
    for key, want in results["torch"].items():
        got = results["triton"][key].sequences[0]
        assert got.tokens.tolist() == want.sequences[0].tokens.tolist(), key
        np.testing.assert_allclose(got.logprobs, want.sequences[0].logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_segments", [1, 2, 3, 64])
def test_any_cut_into_segments_picks_the_same_tokens(max_segments, monkeypatch):
    """One program a row over the whole vocabulary, or segments of one or several blocks (the last
    one short): the same tokens, logprobs equal to rounding."""
    device = kernel_device()
    monkeypatch.setattr(token_draw, "BLOCK", 256)
    vocab, rows = 1800, 10  # 8 blocks, the last one partly past the vocabulary
    monkeypatch.setattr(token_draw, "MAX_SEGMENTS", max_segments)
    assert token_draw.segments(vocab, 256) == {1: (1, 8), 2: (2, 4), 3: (3, 3), 64: (8, 1)}[max_segments]
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(device)
    logits[1, 1799] = 50.0  # a greedy row's largest logit in the last, short block
    temperature = torch.tensor([0.8, 0.0, 1.0, 1.5, 0.3, 1.0, 0.0, 2.0, 1.0, 0.7], device=device)
    u = torch.rand(rows, dtype=torch.float64, generator=g).to(device)
    u[2], u[5] = 0.5 / 2**53, 1.0 - 0.5 / 2**53  # the extremes of `uniforms`: the first entry, the far end
    tok, lp = token_draw.draw(logits, temperature, u)
    want_tok, want_lp = torch_choice(logits, temperature, u)
    assert tok.tolist() == want_tok.tolist()
    assert tok[1].item() == 1799
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)


def test_segments_count_whole_blocks_none_empty():
    assert token_draw.segments(151_936, 4096) == (38, 1)
    for vocab in (1, 255, 256, 257, 5000, 151_936):
        for block in (256, 1024, 4096):
            count, per = token_draw.segments(vocab, block)
            assert (count - 1) * per * block < vocab <= count * per * block  # the last segment holds entries


def test_segments_of_minus_infinity_take_no_weight(monkeypatch):
    """Whole segments of -inf logits (tokens a model rules out), the first one among them: no NaN,
    the draw among the finite entries, logprobs normalised over them."""
    device = kernel_device()
    monkeypatch.setattr(token_draw, "BLOCK", 256)
    vocab, rows = 1024, 4
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(rows, vocab, generator=g)
    logits[:, :512] = float("-inf")  # the first two segments
    logits[:, 700:800] = float("-inf")
    logits = logits.to(device)
    temperature = torch.tensor([1.0, 0.0, 0.6, 1.0], device=device)
    u = torch.tensor([0.3, 0.5, 0.999, 0.5 / 2**53], dtype=torch.float64, device=device)
    tok, lp = token_draw.draw(logits, temperature, u)
    want_tok, want_lp = torch_choice(logits, temperature, u)
    assert tok.tolist() == want_tok.tolist()
    assert all(t >= 512 and not 700 <= t < 800 for t in tok.tolist())
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)



def test_the_kernel_hashes_the_uniforms_bit_for_bit():
    """The pick kernel's own uniforms are ``keyed_uniforms``' to the last bit, at the int64 range's
    ends and where ``keys + step`` wraps; and a step drawn from keys equals one drawn from the
    uniforms torch made."""
    import triton
    import triton.language as tl

    device = kernel_device()

    @triton.jit
    def hashed(keys_ptr, steps_ptr, out_ptr):
        i = tl.program_id(0)
        x = tl.load(keys_ptr + i).to(tl.int64) + tl.load(steps_ptr + i).to(tl.int64)
        tl.store(out_ptr + i, token_draw._keyed_uniform(x))

    g = torch.Generator().manual_seed(5)
    edges = [0, -1, 1, 2**63 - 1, -2**63, 2**62, -2**62 + 7]
    keys = torch.cat([torch.tensor(edges), torch.randint(-2**63, 2**63 - 1, (200,), generator=g)])
    steps = torch.cat([torch.tensor([0, 0, 0, 1, 0, 2**62, 5]), torch.randint(0, 1 << 20, (200,), generator=g)])
    keys, steps = keys.to(device), steps.to(device)
    got = torch.empty(keys.shape[0], dtype=torch.float64, device=device)
    hashed[(keys.shape[0],)](keys, steps, got)
    want = keyed_uniforms(keys, steps)
    assert torch.equal(got, want)
    assert ((got > 0) & (got < 1)).all()
    rows = 12
    logits = (torch.randn(rows, 3000, generator=g) * 3).to(device)
    temperature = torch.tensor([1.0, 0.0, 0.7] * 4, device=device)
    tok, lp = token_draw.draw(logits, temperature, KeyedUniforms(keys[:rows], steps[:rows]))
    want_tok, want_lp = token_draw.draw(logits, temperature, keyed_uniforms(keys[:rows], steps[:rows]))
    assert tok.tolist() == want_tok.tolist() and torch.equal(lp, want_lp)
    torch_tok, _ = torch_choice(logits, temperature, keyed_uniforms(keys[:rows], steps[:rows]))
    assert tok.tolist() == torch_tok.tolist()


_COMPILE = BUILD_PRELUDE + """
from tinsmith.kernels import token_draw

for dt in sys.argv[1:]:
    sig = {"logits_ptr": f"*{dt}", "temp_ptr": "*fp32", "stats_ptr": "*fp32", "best_ptr": "*i64",
           "tok_ptr": "*i64", "lp_ptr": "*fp32", "vocab": "i32", "stride_row": "i64", "stride_stat": "i64"}
    for block, sample, count, per in ((4096, True, 38, 1), (4096, False, 38, 1), (1024, True, 5, 3), (4096, True, 1, 38)):
        const = {"BLOCK": block, "SAMPLE": sample, "COUNT": count, "PER": per, "PDL": dt == "bf16"}
        build(token_draw._segments_kernel, sig, const)
        for keyed in (False, True):  # the uniforms given, or hashed from keys and steps
            draws = {"u_ptr": "*i64", "step_ptr": "*i64"} if keyed else {"u_ptr": "*fp64", "step_ptr": "*fp64"}
            build(token_draw._pick_kernel, {**sig, **draws},
                  {**const, "COUNT_P2": triton.next_power_of_2(count), "KEYED": keyed})
"""


def test_kernels_compile_for_hopper(tmp_path):
    assert_builds_for_hopper(_COMPILE, tmp_path, "bf16", "fp32")
