"""gpt-oss against transformers' GptOssForCausalLM: logits, gradients, decode past the sliding
window, MXFP4 expert weights."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.sampling.conftest import forward_logprobs, make_sampler, run, task
from tests.models.helpers import (assert_merged_export_matches, assert_packed_equals_separate, assert_step_matches_peft,
                                  cross_entropy_step, drop_packed_gate_up, logits_of, perturbed_adapter, ref_loss,
                                  reference_model)
from tests.worker.helpers import assert_rel_close, sft_datum
from tinsmith.models.gpt_oss import dequantize_mxfp4
from tinsmith.models.layers import CausalLM
from tinsmith.models.loading import load_model
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

VOCAB = 512
WINDOW = 16  # SMALL's sliding window (layer 0 slides, layer 1 is full attention)


def test_config_reads_gpt_oss_switches(gpt_oss_dir):
    cfg = load_model(str(gpt_oss_dir)).config
    assert cfg.family == "gpt_oss" and cfg.attention_sinks and cfg.attention_out_bias
    assert [cfg.window_of(i) for i in range(2)] == [WINDOW, None]
    assert cfg.rope.kind == "yarn" and cfg.moe.softmax_after_topk and cfg.moe.activation == "clamped_swiglu"


def test_yarn_at_the_released_settings_equals_transformers():
    """gpt-oss's own rope settings (factor 32 over 4096 positions, theta 150000, no truncation),
    as its hub config.json spells them, give transformers' YaRN frequencies and scale."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tinsmith.models.layers import rope_attention_scaling, rope_inv_freq
    from tinsmith.models.registry import family_for

    hub = {"architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
           "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 24, "vocab_size": 201088,
           "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "rope_theta": 150000,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}}
    cfg = family_for(hub).config(hub)
    assert [cfg.window_of(i) for i in range(3)] == [128, None, 128]
    theirs, scale = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig())
    torch.testing.assert_close(rope_inv_freq(cfg.head_dim, cfg.rope), theirs, rtol=1e-6, atol=0)
    assert rope_attention_scaling(cfg.rope) == pytest.approx(scale)


def test_logits_match_transformers(gpt_oss_dir):
    """Rows four windows long: sinks, the window, YaRN and the clamped experts all take part."""
    ours = load_model(str(gpt_oss_dir)).model
    ref = reference_model(gpt_oss_dir).eval()
    tokens = torch.randint(0, VOCAB, (3, 4 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = logits_of(ours, tokens)
        torch.testing.assert_close(got, ref(tokens).logits, rtol=1e-5, atol=1e-5)
        # Each gpt-oss part changes the logits (so matching them is not matching a simpler model).
        for switch in ({"sliding_window": None}, {"attention_sinks": False}):
            other = CausalLM(dataclasses.replace(ours.config, **switch))
            other.load_state_dict(ours.state_dict(), strict=False)
            assert float((logits_of(other, tokens) - got).abs().max()) > 1e-3, switch
    assert ours.config.num_params == sum(p.numel() for p in ref.parameters())


def test_full_finetune_grads_match_transformers(gpt_oss_dir):
    """Every weight's gradient (sinks, router, expert biases included) equals transformers'."""
    rt = TrainingRuntime(load_model(str(gpt_oss_dir)).model, full_finetune=True)
    rng = np.random.default_rng(10)
    data = [sft_datum(rng, 40, VOCAB, signed=True), sft_datum(rng, 9, VOCAB, signed=True)]
    res = cross_entropy_step(rt, 0, data)
    ref = reference_model(gpt_oss_dir)
    total, _ = ref_loss(ref, data)
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    for i in range(2):
        experts = f"model.layers.{i}.mlp.experts"
        gate_up = theirs.pop(f"{experts}.gate_up_proj").transpose(1, 2)  # experts x 2I x H
        gate_up_bias = theirs.pop(f"{experts}.gate_up_proj_bias")
        theirs[f"{experts}.gate_proj.weight"], theirs[f"{experts}.up_proj.weight"] = gate_up[:, 0::2], gate_up[:, 1::2]
        theirs[f"{experts}.gate_proj.bias"], theirs[f"{experts}.up_proj.bias"] = gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]
        theirs[f"{experts}.down_proj.weight"] = theirs.pop(f"{experts}.down_proj").transpose(1, 2)
        theirs[f"{experts}.down_proj.bias"] = theirs.pop(f"{experts}.down_proj_bias")
    ours = {n: p.grad for n, p in rt.unit(0).named_params}
    assert set(ours) == set(theirs)
    assert ours["model.layers.0.self_attn.sinks"].abs().sum() > 0
    for n, g in ours.items():
        assert_rel_close(g, theirs[n], 1e-4, n)


def test_lora_targets_attention_and_every_expert(gpt_oss_dir):
    rt = TrainingRuntime(load_model(str(gpt_oss_dir)).model, max_lora_adapters=1, max_lora_rank=8)
    u = rt.create_adapter(LoraSpec(rank=4, seed=1))
    names = dict(rt.unit(u).named_params)
    assert tuple(names["model.layers.1.mlp.experts.gate_proj.lora_A.weight"].shape) == (4, 4, 64)
    assert "model.layers.0.self_attn.o_proj.lora_B.weight" in names
    assert not any("router" in n or "sinks" in n or "bias" in n for n in names)
    rng = np.random.default_rng(2)
    res = cross_entropy_step(rt, u, [sft_datum(rng, 50, VOCAB, signed=True)])
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in names.items() if "lora_B" in n)
    assert np.isfinite(res.metrics["loss:sum"])


def test_greedy_decode_past_the_window_equals_transformers(gpt_oss_dir):
    """Prompts longer than the window decode through the KV cache (its sliding layer masking
    positions that left the window) to transformers' own generate, logprobs to our forward."""
    model = load_model(str(gpt_oss_dir)).model
    rng = np.random.default_rng(1)
    ps = [rng.integers(4, VOCAB, n).tolist() for n in (3 * WINDOW + 5, 7)]
    new = 2 * WINDOW
    res = run(make_sampler(model, gpt_oss_dir), [task(i, p, max_tokens=new, temperature=0.0, stop=[])
                                                 for i, p in enumerate(ps)])
    hf = reference_model(gpt_oss_dir).eval()
    for i, p in enumerate(ps):
        seq = res[i].sequences[0]
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=3)
        assert seq.tokens.tolist() == out[0, len(p):].tolist(), f"prompt {i}"
        lp = forward_logprobs(model, list(p) + seq.tokens.tolist())
        want = lp[len(p) - 1: -1].gather(-1, torch.as_tensor(seq.tokens, dtype=torch.long)[:, None])[:, 0]
        np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=1e-4, rtol=0)


def test_mxfp4_dequantisation_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=g, dtype=torch.uint8)  # experts, rows, groups, bytes
    scales = torch.randint(115, 135, (3, 10, 2), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # experts x in x rows
    assert ours.shape == (3, 10, 64)
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), ours.bfloat16())


def test_mxfp4_checkpoint_loads_as_its_dequantised_weights(tmp_path, gpt_oss_dir):
    """A checkpoint with MXFP4 experts (``*_blocks`` / ``*_scales``, as released) loads to the
    same model as one holding transformers' dequantisation of them in bf16-free fp32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(gpt_oss_dir / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    quant, plain = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows_out = state[name].shape  # experts x in x out
        blocks = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 124, (experts, rows_out, rows_in // 32), generator=g, dtype=torch.uint8)
        del quant[name]
        quant[f"{name}_blocks"], quant[f"{name}_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    dirs = {}
    for kind, tensors in (("mxfp4", quant), ("plain", plain)):
        d = dirs[kind] = tmp_path / kind
        shutil.copytree(gpt_oss_dir, d)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, VOCAB, (2, 40), generator=g)
    with torch.no_grad():
        a = logits_of(load_model(str(dirs["mxfp4"])).model, tokens)
        b = logits_of(load_model(str(dirs["plain"])).model, tokens)
        torch.testing.assert_close(b, reference_model(dirs["plain"]).eval()(tokens).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(a, b)


def _peft_grads_per_expert(peft_model, num_experts: int, rank: int) -> dict[str, torch.Tensor]:
    """peft's gradients under our names (its fused-expert A/B taken apart as the export puts them together)."""
    from tinsmith.models.gpt_oss import from_peft_tensors

    grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad
             for n, p in peft_model.named_parameters() if p.grad is not None}
    return from_peft_tensors(grads, rank)


def test_lora_export_loads_in_peft_with_same_logprobs_and_grads(tmp_path, gpt_oss_dir):
    """The PEFT export (peft's target_parameters adapters of the fused experts) loads onto
    transformers' model; logprobs and every LoRA gradient agree, and it reads back unchanged."""
    import peft

    from tinsmith.checkpoints.peft_format import load_peft_adapter, save_peft_adapter

    rank = 4
    rt = TrainingRuntime(load_model(str(gpt_oss_dir)).model, max_lora_adapters=2, max_lora_rank=8)
    spec = LoraSpec(rank=rank, alpha=8, seed=5)
    u = perturbed_adapter(rt, spec, 11)
    rng = np.random.default_rng(1)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (40, 17)]
    res = cross_entropy_step(rt, u, data)
    tensors = {n: p.detach() for n, p in rt.unit(u).named_params}
    save_peft_adapter(tmp_path / "adapter", spec, tensors, str(gpt_oss_dir), family="gpt_oss")
    back_spec, back = load_peft_adapter(tmp_path / "adapter")
    assert back_spec.train_mlp and back_spec.rank == rank and set(back) == set(tensors)
    for n, t in tensors.items():
        assert torch.equal(back[n], t), n

    ref = peft.PeftModel.from_pretrained(reference_model(gpt_oss_dir), tmp_path / "adapter", is_trainable=True)
    assert_step_matches_peft(rt, u, res, ref, data, rank, _peft_grads_per_expert)


def test_full_finetune_export_loads_in_transformers(tmp_path, gpt_oss_dir):
    """A full fine-tune's weights are written in transformers' fused gpt-oss layout (unquantised):
    transformers and we load them with the same logits."""
    from tinsmith.checkpoints.export import save_hf_model

    full = load_model(str(gpt_oss_dir)).model
    with torch.no_grad():
        full.model.layers[1].mlp.experts.up_proj.weight[2].mul_(1.5)
        full.model.layers[0].mlp.experts.gate_proj.bias[1].add_(0.3)
        full.model.layers[0].self_attn.sinks.mul_(-2.0)
        tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
        expected = logits_of(full, tokens)
    save_hf_model(tmp_path / "full", {n: p for n, p in full.named_parameters()}, gpt_oss_dir)
    with torch.no_grad():
        torch.testing.assert_close(reference_model(tmp_path / "full").eval()(tokens).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits_of(load_model(str(tmp_path / "full")).model, tokens), expected)


def test_cli_exports_keep_the_gpt_oss_adapter_layout(tmp_path, gpt_oss_dir):
    """``tinsmith export --format peft`` rewrites a gpt-oss adapter in the layout peft loads."""
    from safetensors import safe_open

    from tinsmith.checkpoints.export import export_adapter
    from tinsmith.checkpoints.peft_format import load_peft_adapter, save_peft_adapter

    rt = TrainingRuntime(load_model(str(gpt_oss_dir)).model, max_lora_adapters=1, max_lora_rank=8)
    spec = LoraSpec(rank=4, alpha=8, seed=5)
    u = rt.create_adapter(spec)
    tensors = {n: p.detach() for n, p in rt.unit(u).named_params}
    save_peft_adapter(tmp_path / "adapter", spec, tensors, str(gpt_oss_dir), family="gpt_oss")
    export_adapter(tmp_path / "adapter", tmp_path / "peft")
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in set(f.keys())
    _, back = load_peft_adapter(tmp_path / "peft")
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def _quantised_copy(src, dst, seed: int) -> None:
    """``src`` with its experts replaced by random MXFP4 blocks and scales, as released."""
    state = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows_out = state.pop(name).shape
        state[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=g,
                                                dtype=torch.uint8)
        state[f"{name}_scales"] = torch.randint(118, 124, (experts, rows_out, rows_in // 32), generator=g,
                                                dtype=torch.uint8)
    shutil.copytree(src, dst)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("experts", ["plain", "mxfp4"])
def test_merged_export_of_expert_adapters_loads_in_transformers(tmp_path, gpt_oss_dir, experts):
    """``--format merged`` folds the per-expert adapters into gpt-oss's fused experts (written
    unquantised, without a quantization_config): transformers gives our adapted logits."""
    import json

    from tinsmith.checkpoints.export import export_merged
    from tinsmith.checkpoints.peft_format import save_peft_adapter

    base = gpt_oss_dir
    if experts == "mxfp4":
        base = tmp_path / "mxfp4"
        _quantised_copy(gpt_oss_dir, base, seed=6)
        cfg = json.loads((base / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
        (base / "config.json").write_text(json.dumps(cfg))
    rt, (u, _) = _two_tenants(base)
    tensors = {n: p.detach() for n, p in rt.unit(u).named_params}
    assert any(".mlp.experts." in n for n in tensors)
    save_peft_adapter(tmp_path / "adapter", LoraSpec(rank=4, seed=1), tensors, str(base), family="gpt_oss")
    merged = export_merged(tmp_path / "adapter", tmp_path / "merged", str(base)).path
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    assert_merged_export_matches(rt, u, merged, VOCAB)


def test_full_fine_tune_export_of_an_mxfp4_base_says_its_experts_are_plain(tmp_path, gpt_oss_dir):
    """A full fine-tune of a released (MXFP4) gpt-oss is exported with plain experts, so its config
    drops ``quantization_config``; transformers loads it with the run's logits, and the export
    reads back as stored sampler weights."""
    import json

    from tinsmith.checkpoints.export import save_hf_model
    from tinsmith.worker.service import RuntimeOptions, Worker

    base = tmp_path / "mxfp4"
    _quantised_copy(gpt_oss_dir, base, seed=7)
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (base / "config.json").write_text(json.dumps(cfg))
    w = Worker(RuntimeOptions(device="cpu", dtype="float32"))
    w.add_base_model("m", str(base))
    w.create_model("full", "m", None)
    weights, b = w.full_weights("full")
    save_hf_model(tmp_path / "export", weights, b.loaded.model_dir)
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    tokens = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = logits_of(w.placement("full").runtime.model, tokens)
        torch.testing.assert_close(reference_model(tmp_path / "export").eval()(tokens).logits, ours,
                                   rtol=1e-5, atol=1e-5)
    assert w.make_resident(w.load_snapshot("stored", "m", tmp_path / "export"))


def _two_tenants(model_dir):
    rt = TrainingRuntime(load_model(str(model_dir)).model, max_lora_adapters=3, max_lora_rank=8)
    units = []
    g = torch.Generator().manual_seed(4)
    for r, s in ((4, 1), (8, 2)):
        u = rt.create_adapter(LoraSpec(rank=r, seed=s))
        with torch.no_grad():
            for n, p in rt.unit(u).named_params:
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        units.append(u)
    return rt, units


def test_packed_gate_up_inference_equals_separate_projections(gpt_oss_dir):
    """Inference runs gate and up (biases included) as one grouped matmul over a shared buffer."""
    rt, units = _two_tenants(gpt_oss_dir)
    assert rt.model.model.layers[0].mlp.experts.packed_gate_up.intact()
    assert_packed_equals_separate(rt, units, 40, VOCAB, drop_packed_gate_up)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
def test_grouped_matmul_path_equals_the_expert_loop(gpt_oss_dir, monkeypatch):
    from tinsmith.models import moe

    rng = np.random.default_rng(3)
    data = [[sft_datum(rng, n, VOCAB, signed=True) for n in (30, 9)] for _ in range(2)]
    results = {}
    for mode in ("loop", "grouped"):
        monkeypatch.setattr(moe, "GROUPED_MM", mode)
        rt, units = _two_tenants(gpt_oss_dir)
        out = rt.forward_backward([TrainRequest(u, ForwardBackwardInput(d, "cross_entropy", {}, False))
                                   for u, d in zip(units, data)])
        results[mode] = (out, [{n: p.grad for n, p in rt.unit(u).named_params} for u in units])
    (loop, loop_g), (grouped, grouped_g) = results["loop"], results["grouped"]
    for a, b in zip(loop, grouped):
        for x, y in zip(a.outputs, b.outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-5)
    for ga, gb in zip(loop_g, grouped_g):
        for n in ga:
            assert_rel_close(gb[n], ga[n], 1e-4, n)


@pytest.mark.parametrize("heads", ["grouped", "repeat"])
def test_sink_attention_through_sdpa_equals_the_eager_softmax(heads, monkeypatch):
    """The SDPA form (the sink as one extra key) equals transformers' eager softmax with sinks,
    values and gradients (q, k, v and the sinks), under a sliding-window mask with GQA: with the
    grouped heads handed to SDPA (CPUs), or K/V repeated per query head (CUDA, where no fused
    kernel takes a mask and grouped heads together)."""
    from tinsmith.models import layers
    from tinsmith.models.layers import _sink_as_key, eager_sink_attention

    monkeypatch.setattr(layers, "MASKED_GQA", heads)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((2, 4, 30, 16), (2, 2, 30, 16), (2, 2, 30, 16)))
    sinks = (torch.randn(4, generator=g, dtype=torch.float64) * 3).requires_grad_()
    i = torch.arange(30)
    allowed = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 7))[None]
    outs = []
    for fn in (eager_sink_attention, _sink_as_key):
        out = fn(q, k, v, allowed, sinks)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum(),
                                    (q, k, v, sinks))
        outs.append((out.detach(), grads))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_masked_attention_repeating_key_value_heads_equals_grouped_heads(monkeypatch):
    """Masked attention without sinks (a prompt over a cached prefix, packed documents): K/V
    repeated per query head (CUDA) and grouped heads (CPUs) give the same values and gradients."""
    from tinsmith.models import layers

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((2, 6, 12, 16), (2, 2, 40, 16), (2, 2, 40, 16)))
    allowed = torch.arange(40)[None, :] <= torch.arange(28, 40)[:, None]  # 12 queries after 28 cached keys
    outs = []
    for heads in ("grouped", "repeat"):
        monkeypatch.setattr(layers, "MASKED_GQA", heads)
        out = layers.masked_attention(q, k, v, allowed[None], None)
        outs.append((out.detach(), torch.autograd.grad(out.square().sum(), (q, k, v))))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_rms_norm_in_bf16_rounds_as_transformers():
    """gpt-oss scales by the norm weight in fp32 and rounds once (its norms stay fp32 in
    transformers); with bf16 activations and weights ours gives the same bits."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from tinsmith.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 64, generator=g) * 3).bfloat16()
    w = (torch.rand(64, generator=g) + 0.5).bfloat16()
    theirs = GptOssRMSNorm(64, eps=1e-5)
    ours = RMSNorm(64, 1e-5, scale_in_fp32=True)
    with torch.no_grad():
        theirs.weight.copy_(w.float())
        ours.weight.data = w
        assert torch.equal(ours(x), theirs(x))
        plain = RMSNorm(64, 1e-5)
        plain.weight.data = w
        assert not torch.equal(plain(x), theirs(x))  # the other families' order rounds differently here
