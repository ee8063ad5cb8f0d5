"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: logits, gradients, peft adapters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tinsmith.checkpoints.peft_format import save_peft_adapter
from tinsmith.models import moe
from tinsmith.models.loading import load_model
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest
from tests.models.helpers import (assert_merged_export_matches, assert_micro_batching_equals_plain,
                                  assert_packed_equals_separate, assert_step_matches_peft, cross_entropy_step,
                                  drop_packed_gate_up, logits_of, logits_with, perturbed_adapter, ref_loss,
                                  reference_model)
from tests.worker.helpers import assert_rel_close, sft_datum

VOCAB = 512


def test_logits_match_transformers(qwen3_moe_dir):
    ours = load_model(str(qwen3_moe_dir))
    assert ours.config.family == "qwen3_moe" and ours.config.moe.num_experts == 4
    ref = reference_model(qwen3_moe_dir).eval()
    tokens = torch.randint(0, VOCAB, (3, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(logits_of(ours.model, tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)
    assert ours.config.num_params == sum(p.numel() for p in ref.parameters())


def test_fused_expert_layout_loads_the_same(tmp_path, qwen3_moe_dir):
    """transformers 5 keeps experts fused in memory (gate_up_proj); a checkpoint saved that way loads too."""
    import shutil

    ref = reference_model(qwen3_moe_dir)
    fused = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    d = tmp_path / "fused"
    shutil.copytree(qwen3_moe_dir, d)
    save_file(fused, d / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        a = logits_of(load_model(str(d)).model, tokens)
        b = logits_of(load_model(str(qwen3_moe_dir)).model, tokens)
    assert torch.equal(a, b)


def test_full_finetune_grads_match_transformers(qwen3_moe_dir):
    """Every weight's gradient, router included: the routing weights backpropagate as transformers'."""
    rt = TrainingRuntime(load_model(str(qwen3_moe_dir)).model, full_finetune=True)
    rng = np.random.default_rng(10)
    data = [sft_datum(rng, 25, VOCAB, signed=True), sft_datum(rng, 9, VOCAB, signed=True)]
    res = cross_entropy_step(rt, 0, data)
    ref = reference_model(qwen3_moe_dir)
    total, _ = ref_loss(ref, data)
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    ours = {n: p.grad for n, p in rt.unit(0).named_params}
    for i in range(2):
        experts = f"model.layers.{i}.mlp.experts"
        gate_up = theirs.pop(f"{experts}.gate_up_proj")
        half = gate_up.shape[1] // 2
        theirs[f"{experts}.gate_proj.weight"] = gate_up[:, :half]
        theirs[f"{experts}.up_proj.weight"] = gate_up[:, half:]
        theirs[f"{experts}.down_proj.weight"] = theirs.pop(f"{experts}.down_proj")
        assert ours[f"model.layers.{i}.mlp.gate.weight"].abs().sum() > 0
    assert set(ours) == set(theirs)
    for n, g in ours.items():
        assert_rel_close(g, theirs[n], 1e-4, n)


def test_lora_export_loads_in_peft_with_same_logprobs_and_grads(tmp_path, qwen3_moe_dir):
    """The PEFT export (per-expert names) loads onto transformers' fused experts through peft's own
    conversion; logprobs and every LoRA gradient (attention and each expert's A/B) agree."""
    import peft

    rank = 4
    rt = TrainingRuntime(load_model(str(qwen3_moe_dir)).model, max_lora_adapters=2, max_lora_rank=8)
    spec = LoraSpec(rank=rank, alpha=8, seed=5)
    u = perturbed_adapter(rt, spec, 11)
    rng = np.random.default_rng(1)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (33, 17)]
    res = cross_entropy_step(rt, u, data)
    names = dict(rt.unit(u).named_params)
    assert tuple(names["model.layers.0.mlp.experts.gate_proj.lora_A.weight"].shape) == (4, rank, 64)
    assert "model.layers.0.mlp.gate.lora_A.weight" not in names  # the router is not trained

    save_peft_adapter(tmp_path / "adapter", spec, {n: p.detach() for n, p in names.items()}, str(qwen3_moe_dir))
    ref = peft.PeftModel.from_pretrained(reference_model(qwen3_moe_dir), tmp_path / "adapter", is_trainable=True)
    assert_step_matches_peft(rt, u, res, ref, data, rank)


def _batches():
    rng = np.random.default_rng(3)
    return [[sft_datum(rng, n, VOCAB, signed=True) for n in (21, 9)] for _ in range(2)]


def _two_tenants(model_dir):
    rt = TrainingRuntime(load_model(str(model_dir)).model, max_lora_adapters=3, max_lora_rank=8)
    return rt, [perturbed_adapter(rt, LoraSpec(rank=r, seed=s), s) for r, s in ((4, 1), (8, 2))]


def _run(rt, pairs):
    results = rt.forward_backward([TrainRequest(u, ForwardBackwardInput(d, "cross_entropy", {}, False))
                                   for u, d in pairs])
    assert not any(isinstance(r, Exception) for r in results), results
    return results


def _assert_same(rt_a, units_a, res_a, rt_b, units_b, res_b, tol):
    for ua, ub, ra, rb in zip(units_a, units_b, res_a, res_b):
        for a, b in zip(ra.outputs, rb.outputs):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=tol, atol=tol)
        for (n, p), (_, q) in zip(rt_a.unit(ua).named_params, rt_b.unit(ub).named_params):
            assert_rel_close(q.grad, p.grad, tol * 10, n)


def test_tenants_in_one_batch_equal_separate_batches(qwen3_moe_dir, monkeypatch):
    """Two adapters share one batch (each one's rows picked out of the expert-sorted rows) exactly
    as if each ran alone."""
    monkeypatch.setattr(moe, "GROUPED_MM", "loop")
    batches = _batches()
    rt, units = _two_tenants(qwen3_moe_dir)
    together = _run(rt, list(zip(units, batches)))
    alone_rt, alone_units = _two_tenants(qwen3_moe_dir)
    alone = [_run(alone_rt, [(u, d)])[0] for u, d in zip(alone_units, batches)]
    _assert_same(rt, units, together, alone_rt, alone_units, alone, 1e-5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
def test_grouped_matmul_path_equals_the_expert_loop(qwen3_moe_dir, monkeypatch):
    batches = _batches()
    results = {}
    for mode in ("loop", "grouped"):
        monkeypatch.setattr(moe, "GROUPED_MM", mode)
        rt, units = _two_tenants(qwen3_moe_dir)
        results[mode] = (rt, units, _run(rt, list(zip(units, batches))))
    _assert_same(*results["loop"], *results["grouped"], 1e-5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
def test_tenants_past_one_grouped_call_are_cut_into_several(qwen3_moe_dir, monkeypatch):
    """A GPU's grouped matmul takes fewer than 1024 groups; adapters x experts can pass that
    (8 tenants of a 128-expert model). Tenants then go through several grouped calls, none past
    the limit, with the same logprobs and gradients as the expert loop (here: a limit of 8 groups
    and 4 experts, so 3 tenants take two calls)."""
    groups = []
    grouped_mm = torch._grouped_mm

    def counted(a, b, *args, offs=None, **kwargs):
        groups.append(offs.numel())
        return grouped_mm(a, b, *args, offs=offs, **kwargs)

    monkeypatch.setattr(moe, "MAX_GROUPS", 8)
    monkeypatch.setattr(torch, "_grouped_mm", counted)
    rng = np.random.default_rng(4)
    batches = [[sft_datum(rng, n, VOCAB, signed=True) for n in (13, 7)] for _ in range(3)]
    results = {}
    for mode in ("loop", "grouped"):
        monkeypatch.setattr(moe, "GROUPED_MM", mode)
        rt = TrainingRuntime(load_model(str(qwen3_moe_dir)).model, max_lora_adapters=4, max_lora_rank=8)
        units = [perturbed_adapter(rt, LoraSpec(rank=r, seed=s), s) for r, s in ((4, 1), (8, 2), (4, 3))]
        groups.clear()
        results[mode] = (rt, units, _run(rt, list(zip(units, batches))))
    assert groups and max(groups) <= 8 and 8 in groups, groups  # two tenants' experts per call, at most
    _assert_same(*results["loop"], *results["grouped"], 1e-5)


def test_single_token_steps_equal_the_full_forward(qwen3_moe_dir):
    """Decode feeds one token per step (one routed row per token, a kv cache for attention)."""
    from tinsmith.models.layers import causal_attention

    model = load_model(str(qwen3_moe_dir)).model
    rt = TrainingRuntime(model, max_lora_adapters=1, max_lora_rank=4)
    u = perturbed_adapter(rt, LoraSpec(rank=4, seed=9), 9)
    slot = rt.unit(u).slot
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cached(layer_idx, q, k, v):
        if layer_idx in cache:
            k, v = torch.cat((cache[layer_idx][0], k), 2), torch.cat((cache[layer_idx][1], v), 2)
        cache[layer_idx] = (k, v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with torch.no_grad():
        full = model.logits(model.hidden_states(tokens, torch.arange(12)[None], [(slot, 0, 12)], causal_attention),
                            [(slot, 0, 12)])
        steps = [model.logits(model.hidden_states(tokens[:, t:t + 1], torch.tensor([[t]]), [(slot, 0, 1)], cached),
                              [(slot, 0, 1)]) for t in range(12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_merged_and_full_weight_exports_load_in_transformers(tmp_path, qwen3_moe_dir):
    """``tinsmith export`` merges per-expert adapters into per-expert weights; a full fine-tune's
    weights are written the same way; transformers loads both with our logits."""
    from tinsmith.checkpoints.export import export_merged, save_hf_model

    rt = TrainingRuntime(load_model(str(qwen3_moe_dir)).model, max_lora_adapters=1, max_lora_rank=8)
    spec = LoraSpec(rank=4, alpha=8, seed=5)
    u = perturbed_adapter(rt, spec, 12)
    tensors = {n: p.detach() for n, p in rt.unit(u).named_params}
    save_peft_adapter(tmp_path / "adapter", spec, tensors, str(qwen3_moe_dir))
    merged = export_merged(tmp_path / "adapter", tmp_path / "merged", str(qwen3_moe_dir)).path
    tokens = assert_merged_export_matches(rt, u, merged, VOCAB)

    full = load_model(str(qwen3_moe_dir)).model
    with torch.no_grad():
        full.model.layers[1].mlp.experts.down_proj.weight[2].mul_(1.5)
        full.model.layers[0].mlp.gate.weight.mul_(-1.0)
        expected = logits_of(full, tokens)
    save_hf_model(tmp_path / "full", {n: p for n, p in full.named_parameters()}, qwen3_moe_dir)
    with torch.no_grad():
        torch.testing.assert_close(reference_model(tmp_path / "full").eval()(tokens).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits_of(load_model(str(tmp_path / "full")).model, tokens), expected)


def test_incomplete_moe_config_is_a_clear_error(tmp_path, qwen3_moe_dir):
    import json
    import shutil

    from tinsmith.errors import InvalidInputError

    d = tmp_path / "broken"
    shutil.copytree(qwen3_moe_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidInputError, match="moe_intermediate_size"):
        load_model(str(d))
    cfg["moe_intermediate_size"], cfg["num_experts_per_tok"] = 64, 9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidInputError, match="num_experts_per_tok"):
        load_model(str(d))


def test_packed_gate_up_inference_equals_separate_projections(qwen3_moe_dir):
    """Inference runs each layer's expert gate and up as one grouped matmul over a shared buffer."""
    rt, units = _two_tenants(qwen3_moe_dir)
    assert rt.model.model.layers[0].mlp.experts.packed_gate_up.intact()
    assert_packed_equals_separate(rt, units, 20, VOCAB, drop_packed_gate_up)


def test_micro_batching_and_checkpointing_equal_plain_path(qwen3_moe_dir):
    rng = np.random.default_rng(6)
    assert_micro_batching_equals_plain(qwen3_moe_dir, [sft_datum(rng, n, VOCAB, signed=True) for n in (5, 50, 17, 33)])


def test_base_model_rows_beside_adapter_rows_are_the_base_model(qwen3_moe_dir):
    rt, units = _two_tenants(qwen3_moe_dir)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    rows = [(None, 0, 16), (rt.unit(units[1]).slot, 16, 32)]
    with torch.no_grad():
        mixed = logits_with(rt.model, tokens, rows)
        base = logits_of(rt.model, tokens[:1])
        adapted = logits_with(rt.model, tokens[1:], [(rt.unit(units[1]).slot, 0, 16)])
    torch.testing.assert_close(mixed[:1], base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1:], adapted, rtol=1e-5, atol=1e-5)
    assert (adapted - logits_of(rt.model, tokens[1:])).abs().max() > 1e-3


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_decode_step_never_reads_the_device(family, monkeypatch, request):
    """With the grouped matmul (what bf16 on Hopper takes) a decode step's routed experts, adapters
    through the bank included, read nothing back to the host: what a CUDA graph needs. The expert
    loop (fp32, older GPUs, CPUs) reads the counts, and so stays eager."""
    from tests.sampling.conftest import random_adapter
    from tinsmith.models.lora import RowSlots

    model = load_model(str(request.getfixturevalue(f"{family}_dir"))).model
    random_adapter(model, 1, rank=4, seed=1)
    tokens = torch.tensor([[5], [9], [300]])
    rows = RowSlots.of(model, [1, None, 1], tokens.device)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside the decode step")

    for mode, reads in (("grouped", False), ("loop", True)):
        monkeypatch.setattr(moe, "GROUPED_MM", mode)
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__bool__", "__int__", "__index__"):
                m.setattr(torch.Tensor, name, refuse)
            m.setattr(torch, "bincount", refuse)
            try:
                with torch.inference_mode():
                    model.hidden_states(tokens, torch.zeros_like(tokens), rows)
                read = False
            except AssertionError:
                read = True
        assert read == reads, mode


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
@pytest.mark.parametrize("max_groups", [moe.MAX_GROUPS, 6])  # 6: a range's 2 experts take 2 adapters a call
def test_expert_ranges_with_several_adapters_sum_to_the_whole_block(qwen3_moe_dir, monkeypatch, max_groups):
    """Under expert parallelism each rank's block computes a range of the experts. With several
    adapters in one batch (and rows of none), the ranges' outputs and the adapters' gradients add
    up to the whole block's, on the expert loop and on the grouped matmul; on the grouped matmul
    a range reads the device once (where its pairs start), not once more per adapter, and
    nothing without gradients (a prefill: it keeps every pair, the others' in a zero group)."""
    import copy

    from tinsmith.devtools.host_syncs import HostSyncs

    monkeypatch.setattr(moe, "MAX_GROUPS", max_groups)
    from tinsmith.models.lora import LoraWeights
    from tinsmith.parallel.group import TPGroup
    from tinsmith.parallel.layers import ExpertParallelMoeBlock

    block = load_model(str(qwen3_moe_dir)).model.model.layers[0].mlp
    g = torch.Generator().manual_seed(3)
    slots = (1, 2, 3)
    for slot, rank in zip(slots, (4, 8, 4)):
        for proj in (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj):
            w = proj.add_adapter(slot, rank, 2.0 * rank, g)
            with torch.no_grad():
                w.B.normal_(0.0, 0.05, generator=g)
    x = torch.randn(14, block.experts.gate_proj.in_features, generator=g)
    segments = [(1, 0, 4), (None, 4, 6), (2, 6, 10), (3, 10, 14)]
    n = block.experts.gate_proj.num_experts
    for mode in ("loop", "grouped"):
        monkeypatch.setattr(moe, "GROUPED_MM", mode)
        whole = block(x, segments)
        whole.square().sum().backward()
        expected = {(name, s): (w.A.grad.clone(), w.B.grad.clone())
                    for name in ("gate_proj", "up_proj", "down_proj")
                    for s, w in getattr(block.experts, name).adapters.items()}
        block.zero_grad(set_to_none=True)
        for name in ("gate_proj", "up_proj", "down_proj"):
            for w in getattr(block.experts, name).adapters.values():
                w.A.grad = w.B.grad = None
        total, prefill, reads, prefill_reads = 0, 0, [], []
        for experts in (slice(0, n // 2), slice(n // 2, n)):
            part = ExpertParallelMoeBlock(copy.deepcopy(block), experts, TPGroup(0, 1))
            for name in ("gate_proj", "up_proj", "down_proj"):  # this range's rows of the whole adapters
                for s, w in getattr(block.experts, name).adapters.items():
                    getattr(part.experts, name).adapters[s] = LoraWeights(w.A[experts], w.B[experts], w.scale)
            with HostSyncs() as h:
                total = total + part(x, segments)
            reads.append(h.count("read"))
            with torch.inference_mode(), HostSyncs() as h:
                prefill = prefill + part(x, segments)
            prefill_reads.append(h.count("read"))
        total.square().sum().backward()
        torch.testing.assert_close(total, whole.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prefill, whole.detach(), rtol=1e-5, atol=1e-5)
        for (name, s), (a, b) in expected.items():
            w = getattr(block.experts, name).adapters[s]
            torch.testing.assert_close(w.A.grad, a, rtol=1e-4, atol=1e-6, msg=f"{mode} {name} {s} A")
            torch.testing.assert_close(w.B.grad, b, rtol=1e-4, atol=1e-6, msg=f"{mode} {name} {s} B")
            w.A.grad = w.B.grad = None
        if mode == "grouped":
            assert reads == [1, 1] and prefill_reads == [0, 0], (reads, prefill_reads)


def test_a_capture_blocker_is_named_where_the_experts_loop_over_host_counts(qwen3_moe_dir, qwen3_dir, monkeypatch):
    """Routed experts outside the grouped matmul read their row counts back to the host, which a
    CUDA graph's capture refuses: the sampler is told why before it tries (here, on a CPU, the
    experts loop; with the grouped matmul forced they do not; a dense model never blocks)."""
    ours = load_model(str(qwen3_moe_dir))
    why = moe.capture_blocker(ours.model)
    assert why is not None and "float32" in why and "bf16" in why
    monkeypatch.setattr(moe, "GROUPED_MM", "grouped")
    assert moe.capture_blocker(ours.model) is None
    monkeypatch.setattr(moe, "GROUPED_MM", "auto")
    assert moe.capture_blocker(load_model(str(qwen3_dir)).model) is None
