"""Qwen3.5 and Qwen3.5-MoE against transformers: logits, gradients, peft adapters, greedy decoding."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tinsmith.checkpoints.peft_format import load_peft_adapter, save_peft_adapter
from tinsmith.models.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_step
from tinsmith.models.loading import load_model
from tinsmith.types import LoraSpec
from tinsmith.worker.runtime import TrainingRuntime
from tests.models.helpers import (assert_merged_export_matches, assert_micro_batching_equals_plain,
                                  assert_packed_equals_separate, assert_step_matches_peft, cross_entropy_step,
                                  logits_of, logits_with, perturbed_adapter, ref_loss, reference_model)
from tests.sampling.conftest import forward_logprobs, make_sampler, run, task
from tests.worker.helpers import assert_rel_close, sft_datum

VOCAB = 512
FAMILIES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture
def model_dir(request, qwen3_5_dir, qwen3_5_moe_dir):
    return {"qwen3_5": qwen3_5_dir, "qwen3_5_moe": qwen3_5_moe_dir}[request.param]


def _fused_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert gradients (gate_up_proj, down_proj) under our per-projection names."""
    out = {}
    for n, g in grads.items():
        if n.endswith(".mlp.experts.gate_up_proj"):
            prefix, half = n.removesuffix(".gate_up_proj"), g.shape[1] // 2
            out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = g[:, :half], g[:, half:]
        elif n.endswith(".mlp.experts.down_proj"):
            out[f"{n}.weight"] = g
        else:
            out[n] = g
    return out


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_logits_match_transformers(model_dir):
    """Prompts longer than one 64-token chunk: the state carries across chunks as transformers'."""
    ours = load_model(str(model_dir))
    cfg = ours.config
    assert cfg.layer_types == ("linear_attention", "full_attention") and cfg.rotary_dim == 4
    assert hasattr(ours.model.model.layers[0], "linear_attn") and hasattr(ours.model.model.layers[1], "self_attn")
    ref = reference_model(model_dir).eval()
    tokens = torch.randint(0, VOCAB, (3, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32 through chunked delta rules summed in different orders: 1e-4 (seen up to 4e-5 on AVX2 CPUs)
        torch.testing.assert_close(logits_of(ours.model, tokens), ref(tokens).logits, rtol=1e-5, atol=1e-4)
    assert cfg.num_params == sum(p.numel() for p in ref.parameters())
    assert not cfg.supports_prefix_cache


def test_chunked_delta_rule_equals_the_recurrence():
    """The chunked form (training, prefill) and the one-token update (decode) are the same rule."""
    g = torch.Generator().manual_seed(0)
    b, L, hk, hv, dk, dv = 2, 70, 2, 4, 8, 6
    q, k = torch.randn(b, L, hk, dk, generator=g), torch.randn(b, L, hk, dk, generator=g)
    v = torch.randn(b, L, hv, dv, generator=g)
    decay, beta = -torch.rand(b, L, hv, generator=g), torch.rand(b, L, hv, generator=g)
    out, final = chunk_gated_delta_rule(q, k, v, decay, beta)
    state = torch.zeros(b, hv, dk, dv)
    steps = []
    for t in range(L):
        o, state = recurrent_gated_delta_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], decay[:, t:t + 1],
                                              beta[:, t:t + 1], state)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_full_finetune_grads_match_transformers(model_dir):
    """Every weight's gradient: DeltaNet's conv, decay and gate parameters, experts and the shared one."""
    rt = TrainingRuntime(load_model(str(model_dir)).model, full_finetune=True)
    rng = np.random.default_rng(10)
    data = [sft_datum(rng, 80, VOCAB, signed=True), sft_datum(rng, 9, VOCAB, signed=True)]
    res = cross_entropy_step(rt, 0, data)
    ref = reference_model(model_dir)
    total, _ = ref_loss(ref, data)
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    theirs = _fused_names({n: p.grad for n, p in ref.named_parameters()})
    ours = {n: p.grad for n, p in rt.unit(0).named_params}
    assert set(ours) == set(theirs)
    assert ours["model.layers.0.linear_attn.A_log"].abs().sum() > 0
    for n, g in ours.items():
        assert_rel_close(g, theirs[n], 1e-4, n)


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_lora_export_loads_in_peft_with_same_logprobs_and_grads(tmp_path, model_dir):
    """Adapters on the DeltaNet projections, gated attention, MLP / experts / shared expert and the
    LM head: the PEFT export loads onto transformers' model with our logprobs and LoRA gradients."""
    import peft

    rank = 4
    rt = TrainingRuntime(load_model(str(model_dir)).model, max_lora_adapters=2, max_lora_rank=8)
    spec = LoraSpec(rank=rank, alpha=8, seed=5)
    u = perturbed_adapter(rt, spec, 11)
    names = dict(rt.unit(u).named_params)
    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        assert f"model.layers.0.linear_attn.{proj}.lora_A.weight" in names
    assert "model.layers.1.self_attn.q_proj.lora_B.weight" in names
    rng = np.random.default_rng(1)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (70, 17)]
    res = cross_entropy_step(rt, u, data)

    family = load_model(str(model_dir)).config.family
    save_peft_adapter(tmp_path / "adapter", spec, {n: p.detach() for n, p in names.items()}, str(model_dir),
                      family=family)
    assert "in_proj_qkv" in json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    loaded_spec, loaded = load_peft_adapter(tmp_path / "adapter")  # what a sampler snapshot reloads
    assert loaded_spec.train_attn and loaded_spec.train_mlp and set(loaded) == set(names)
    for n, t in loaded.items():
        torch.testing.assert_close(t, names[n].detach(), rtol=0, atol=0)
    ref = peft.PeftModel.from_pretrained(reference_model(model_dir), tmp_path / "adapter", is_trainable=True)
    assert_step_matches_peft(rt, u, res, ref, data, rank)


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_merged_and_full_weight_exports_load_in_transformers(tmp_path, model_dir):
    """Merged adapters (DeltaNet projections and per-expert weights included) and a full
    fine-tune's weights load in transformers with our logits."""
    from tinsmith.checkpoints.export import export_merged, save_hf_model

    loaded = load_model(str(model_dir))
    rt = TrainingRuntime(loaded.model, max_lora_adapters=1, max_lora_rank=8)
    spec = LoraSpec(rank=4, alpha=8, seed=5)
    u = perturbed_adapter(rt, spec, 12)
    save_peft_adapter(tmp_path / "adapter", spec, {n: p.detach() for n, p in rt.unit(u).named_params},
                      str(model_dir), family=loaded.config.family)
    merged = export_merged(tmp_path / "adapter", tmp_path / "merged", str(model_dir)).path
    tokens = assert_merged_export_matches(rt, u, merged, VOCAB)

    full = load_model(str(model_dir)).model
    with torch.no_grad():
        full.model.layers[0].linear_attn.A_log.mul_(0.5)
        full.model.layers[0].linear_attn.conv1d.weight.mul_(-1.0)
        expected = logits_of(full, tokens)
    save_hf_model(tmp_path / "full", {n: p for n, p in full.named_parameters()}, model_dir)
    with torch.no_grad():
        theirs = reference_model(tmp_path / "full").eval()(tokens).logits
        torch.testing.assert_close(theirs, expected, rtol=1e-5, atol=1e-5)


def _image_text_checkpoint(tmp_path, text_dir):
    """transformers' own ``Qwen3_5ForConditionalGeneration`` around the text model of ``text_dir``
    (its weights under ``model.language_model.``), a small vision tower and an MTP tensor beside."""
    import transformers
    from safetensors.torch import load_file, save_file

    text = json.loads((text_dir / "config.json").read_text())
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=64)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False))
    weights = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
               for k, v in load_file(text_dir / "model.safetensors").items()}
    missing, _ = model.load_state_dict(weights, strict=False)
    assert all(k.startswith("model.visual.") for k in missing)
    d = tmp_path / "vl"
    model.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_dir / f, d / f)
    saved = load_file(d / "model.safetensors")
    saved["mtp.fc.weight"] = torch.zeros(2, 2)  # released checkpoints carry multi-token-prediction weights
    save_file(saved, d / "model.safetensors", metadata={"format": "pt"})
    return d, model.eval()


def test_image_text_checkpoint_serves_its_text_decoder(tmp_path, qwen3_5_dir, caplog):
    """A released-style checkpoint (``Qwen3_5ForConditionalGeneration``) whose directory lacks the
    image processor's settings loads its decoder only (images then refused), with transformers'
    text logits; an adapter's PEFT export loads onto that class with our logprobs."""
    import peft

    d, ref = _image_text_checkpoint(tmp_path, qwen3_5_dir)
    with caplog.at_level("INFO", logger="tinsmith.models.loading"):
        vl = load_model(str(d))
    assert "vision-tower / multi-token-prediction tensors are not loaded" in caplog.text
    assert "no preprocessor_config.json or processor_config.json for its images" in caplog.text
    assert vl.config.text_prefix == "model.language_model." and vl.vision is None
    assert "no preprocessor_config.json or processor_config.json" in vl.config.images_off  # what a refusal says
    tokens = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(logits_of(vl.model, tokens), ref(input_ids=tokens).logits, rtol=1e-5, atol=1e-4)

    rt = TrainingRuntime(vl.model, max_lora_adapters=1, max_lora_rank=8)
    spec = LoraSpec(rank=4, alpha=8, seed=5)
    u = perturbed_adapter(rt, spec, 13)
    rng = np.random.default_rng(2)
    data = [sft_datum(rng, n, VOCAB, signed=True) for n in (40, 11)]
    res = cross_entropy_step(rt, u, data)
    save_peft_adapter(tmp_path / "adapter", spec, {n: p.detach() for n, p in rt.unit(u).named_params}, str(d),
                      text_prefix=vl.config.text_prefix, family=vl.config.family)
    adapted = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter", is_trainable=True)
    _, lps = ref_loss(adapted, data)
    for lp, out in zip(lps, res.outputs):
        np.testing.assert_allclose(out["logprobs"], lp, rtol=1e-5, atol=1e-5)


def test_merged_export_of_an_image_text_checkpoint_keeps_its_layout(tmp_path, qwen3_5_dir):
    """``tinsmith export --format merged`` over a released-style checkpoint: the adapter merged into
    the decoder under ``model.language_model.``, the vision tower and MTP weights as the base's;
    transformers' image-text class loads it with nothing missing and gives the adapted logits."""
    import transformers

    from tinsmith.checkpoints.export import export_merged
    from tinsmith.models.loading import weight_files

    d, _ = _image_text_checkpoint(tmp_path, qwen3_5_dir)
    vl = load_model(str(d))
    rt = TrainingRuntime(vl.model, max_lora_adapters=1, max_lora_rank=8)
    spec = LoraSpec(rank=4, alpha=8, seed=5)
    u = perturbed_adapter(rt, spec, 14)
    save_peft_adapter(tmp_path / "adapter", spec, {n: p.detach() for n, p in rt.unit(u).named_params}, str(d),
                      text_prefix=vl.config.text_prefix, family=vl.config.family)
    merged = export_merged(tmp_path / "adapter", tmp_path / "merged", str(d)).path
    assert weight_files(merged).keys() == weight_files(d).keys()
    ref, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = logits_with(rt.model, tokens, [(rt.unit(u).slot, 0, 60)])
        torch.testing.assert_close(ref.eval()(input_ids=tokens).logits, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_greedy_sampling_equals_transformers_generate(model_dir):
    """Prompts of different lengths (one past a 64-token chunk) prefill together, right-padded;
    the first rows finish first, so the last rows (and their recurrent state) move into their
    places while the others go on decoding."""
    model = load_model(str(model_dir)).model
    rng = np.random.default_rng(4)
    ps = [rng.integers(4, VOCAB, n).tolist() for n in (3, 90, 11)]
    lengths = (5, 20, 12)
    res = run(make_sampler(model, model_dir), [task(i, p, max_tokens=n, temperature=0.0, stop=[], n=2)
                                               for i, (p, n) in enumerate(zip(ps, lengths))])
    hf = reference_model(model_dir).eval()
    for i, (p, n) in enumerate(zip(ps, lengths)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=3)
        for seq in res[i].sequences:
            assert seq.tokens.tolist() == out[0, len(p):].tolist(), f"prompt {i}"
            lp = forward_logprobs(model, list(p) + seq.tokens.tolist())
            want = lp[len(p) - 1: -1].gather(-1, torch.as_tensor(seq.tokens, dtype=torch.long)[:, None])[:, 0]
            np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=1e-4, rtol=0)


def test_adapters_of_many_tenants_sample_in_one_batch(qwen3_5_dir):
    """Base-model rows beside rows of two adapters (DeltaNet projections adapted too): every
    sampled token carries the logprob a full forward pass with its own adapter gives it."""
    model = load_model(str(qwen3_5_dir)).model
    rt = TrainingRuntime(model, max_lora_adapters=3, max_lora_rank=8)
    units = [perturbed_adapter(rt, LoraSpec(rank=r, seed=s), s) for r, s in ((4, 1), (8, 2))]
    slots = [rt.unit(u).slot for u in units]
    rng = np.random.default_rng(5)
    ps = [rng.integers(4, VOCAB, n).tolist() for n in (7, 30, 13)]
    cases = [(None, ps[0], 1.0), (slots[0], ps[1], 0.0), (slots[1], ps[2], 1.0), (slots[0], ps[2], 1.0)]
    res = run(make_sampler(model, qwen3_5_dir), [task(i, p, slot=s, max_tokens=10 + 3 * i, temperature=t, seed=i,
                                                      stop=[], n=2) for i, (s, p, t) in enumerate(cases)])
    for i, (slot, p, _) in enumerate(cases):
        for seq in res[i].sequences:
            lp = forward_logprobs(model, list(p) + seq.tokens.tolist(), slot)
            want = lp[len(p) - 1: -1].gather(-1, torch.as_tensor(seq.tokens, dtype=torch.long)[:, None])[:, 0]
            np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=1e-4, rtol=0)
    base, adapted = forward_logprobs(model, ps[1]), forward_logprobs(model, ps[1], slots[0])
    assert float((base - adapted).abs().max()) > 1e-2  # the adapters matter


def test_micro_batching_and_checkpointing_equal_plain_path(qwen3_5_dir):
    rng = np.random.default_rng(6)
    assert_micro_batching_equals_plain(qwen3_5_dir, [sft_datum(rng, n, VOCAB, signed=True) for n in (5, 70, 17, 33)])


def test_a_prompt_admitted_while_others_decode_keeps_their_states(qwen3_5_dir):
    """A new prompt's prefill writes its own rows' states; rows already decoding keep theirs."""
    model = load_model(str(qwen3_5_dir)).model
    sampler = make_sampler(model, qwen3_5_dir)
    rng = np.random.default_rng(8)
    first, second = rng.integers(4, VOCAB, 9).tolist(), rng.integers(4, VOCAB, 70).tolist()
    sampler.add(task("first", first, max_tokens=30, temperature=0.0, stop=[], n=2))
    done = dict(sampler.step(0.0))  # the prefill and one decode step
    assert not done and sampler.rows and len(sampler.rows[0].tokens) < 30
    res = {**done, **run(sampler, [task("second", second, max_tokens=12, temperature=1.0, seed=3, stop=[])])}
    for key, prompt in (("first", first), ("second", second)):
        for seq in res[key].sequences:
            lp = forward_logprobs(model, list(prompt) + seq.tokens.tolist())
            want = lp[len(prompt) - 1: -1].gather(-1, torch.as_tensor(seq.tokens, dtype=torch.long)[:, None])[:, 0]
            np.testing.assert_allclose(seq.logprobs, want.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_packed_input_projections_equal_separate_ones(model_dir):
    """Inference runs DeltaNet's four input projections (and the shared expert's gate/up) as one
    GEMM over a shared buffer, adapters of two tenants included."""
    rt = TrainingRuntime(load_model(str(model_dir)).model, max_lora_adapters=3, max_lora_rank=8)
    units = [perturbed_adapter(rt, LoraSpec(rank=r, seed=s), s) for r, s in ((4, 1), (8, 2))]
    assert rt.model.model.layers[0].linear_attn.packed_in.intact()
    assert_packed_equals_separate(rt, units, 20, VOCAB, _unpack)


def _unpack(layer) -> None:
    """Drop a layer's packed inference projections (DeltaNet's inputs, the shared expert's gate/up)."""
    if hasattr(layer, "linear_attn"):
        layer.linear_attn.packed_in = None
    if hasattr(layer.mlp, "shared_expert"):
        layer.mlp.shared_expert.packed_gate_up = None


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_bfloat16_logits_follow_transformers(model_dir):
    """In bf16 (the GPU default) the fp32 islands (norms, decay, delta rule) sit where transformers'
    are, so logits agree to bf16 rounding."""
    import transformers

    ours = load_model(str(model_dir), dtype=torch.bfloat16).model
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                            experts_implementation="eager").eval()
    tokens = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # bf16 rounding: a large logit may differ by one bf16 step (2**-7 of its size)
        torch.testing.assert_close(logits_of(ours, tokens), ref(tokens).logits.float(), rtol=2 ** -7, atol=2e-2)


def test_qwen3_6_35b_a3b_config_reads_as_qwen3_5_moe(tmp_path):
    """Qwen3.6 checkpoints declare Qwen3.5's model_type and classes (transformers' docs): a config.json
    written by transformers' own ``Qwen3_5MoeConfig`` with Qwen3.6-35B-A3B's published shape (40
    layers of 3 Gated DeltaNet : 1 gated attention, 256 experts with 8 routed and a shared one,
    rotary on a quarter of each 256-wide head) reads as that shape, without its weights."""
    import transformers

    from tinsmith.models.loading import read_config

    text = dict(hidden_size=2048, num_hidden_layers=40, full_attention_interval=4, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248_320)
    config = transformers.Qwen3_5MoeConfig(text_config=text, architectures=["Qwen3_5MoeForConditionalGeneration"])
    config.save_pretrained(tmp_path)
    cfg = read_config(tmp_path)
    assert cfg.family == "qwen3_5_moe" and cfg.text_prefix == "model.language_model."
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + cfg.layer_types[4:]
    assert cfg.layer_types.count("full_attention") == 10 and cfg.rotary_dim == 64
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (16, 2, 256, 248_320)
    la = cfg.linear_attn
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim) == (16, 32, 128, 128)
    moe = cfg.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size) == (256, 8, 512, 512)


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_a_prompt_sent_again_later_is_not_prefilled_again(model_dir):
    """GRPO as separate requests arriving in different steps: a hybrid model keeps the whole
    prompt's prefill (K/V, recurrent states, last logits), so the later requests skip theirs and
    sample exactly what a sampler without that memory samples; a changed adapter, a new prompt
    and a request asking prompt logprobs are prefilled."""
    model = load_model(str(model_dir)).model
    spec = LoraSpec(rank=4, seed=2)
    rt = TrainingRuntime(model)
    slot = rt.unit(perturbed_adapter(rt, spec, seed=4)).slot  # an adapter that changes the outputs
    rng = np.random.default_rng(5)
    prompt, other = rng.integers(4, VOCAB, 40).tolist(), rng.integers(4, VOCAB, 12).tolist()
    requests = [("a", prompt, None, False), ("b", prompt, None, False), ("c", prompt, slot, False),
                ("d", prompt, slot, False), ("e", other, None, False), ("f", prompt, None, True)]

    def sample(prefix_cache_bytes: int) -> tuple[dict, dict]:
        sampler = make_sampler(model, model_dir, prefix_cache_bytes=prefix_cache_bytes)
        out = {}
        for key, p, s, logprobs in requests:  # one admission each
            t = task(key, p, slot=s, max_tokens=6, temperature=1.0, seed=7, stop=[], n=2)
            t.input.prompt_logprobs = logprobs
            out.update(run(sampler, [t]))
        return out, sampler.stats

    want, plain = sample(0)
    got, stats = sample(1 << 30)
    assert plain["prefills"] == 6 and stats["prefills"] == 4  # "b" and "d" reused "a" and "c"
    assert stats["cached_prompt_tokens"] == 2 * len(prompt)
    for key in want:
        for w, g in zip(want[key].sequences, got[key].sequences):
            np.testing.assert_array_equal(w.tokens, g.tokens)
            np.testing.assert_allclose(w.logprobs, g.logprobs, atol=1e-6, rtol=0)
    assert not np.array_equal(want["a"].sequences[0].logprobs, want["c"].sequences[0].logprobs)  # the adapter counts


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_prompts_continue_kept_ones_together_and_share_a_common_beginning_once(model_dir):
    """Three conversations' next turns, admitted together, each continue from their kept turn in
    one prefill. Prompts behind one 70-token system prompt: the first is prefilled whole; the
    next wave shares the system prompt's prefill once (it is kept then), and a later prompt
    continues from it. Each admission computes only that; results are a plain sampler's."""
    model = load_model(str(model_dir)).model
    rng = np.random.default_rng(11)
    convs = [rng.integers(4, VOCAB, 20 + 3 * i).tolist() for i in range(3)]
    system = rng.integers(4, VOCAB, 70).tolist()
    admissions = [
        [(f"c{i}", c) for i, c in enumerate(convs)],
        [(f"next{i}", c + rng.integers(4, VOCAB, 9).tolist()) for i, c in enumerate(convs)],
        [("w1", system + rng.integers(4, VOCAB, 10).tolist())],
        [(f"w2-{i}", system + rng.integers(4, VOCAB, 12 + i).tolist()) for i in range(3)],
        [("w3", system + rng.integers(4, VOCAB, 8).tolist())],
    ]

    def sample(prefix_cache_bytes: int) -> tuple[dict, list[int]]:
        sampler = make_sampler(model, model_dir, prefix_cache_bytes=prefix_cache_bytes)
        out, computed = {}, []
        for admission in admissions:  # each admitted whole, in one prefill
            before = sampler.stats["prefill_tokens"]
            out.update(run(sampler, [task(k, p, max_tokens=6, temperature=1.0, seed=7, stop=[], n=2)
                                     for k, p in admission]))
            computed.append(sampler.stats["prefill_tokens"] - before)
        return out, computed

    want, plain = sample(0)
    got, computed = sample(1 << 30)
    assert plain == [sum(len(p) for _, p in admission) for admission in admissions]
    assert computed == [plain[0], 3 * 9, plain[2], 70 + plain[3] - 3 * 70, plain[4] - 70]
    assert [got[k].prompt_cache_hit_tokens for k in ("w2-0", "w2-1", "w2-2", "w3")] == [0, 70, 70, 70]
    for key in want:
        for w, g in zip(want[key].sequences, got[key].sequences):
            np.testing.assert_array_equal(w.tokens, g.tokens)
            np.testing.assert_allclose(w.logprobs, g.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_a_prompt_extending_a_kept_one_prefills_only_its_new_tokens(model_dir):
    """Multi-turn: each turn's prompt repeats the conversation so far and adds to it. A hybrid
    model continues from the kept states of the turn before (turn 3 from turn 2's, kept after its
    own continued prefill); a long prompt prefilled in chunks is kept too, sent again it is not
    prefilled, extended it prefills its new tokens only. Every request samples exactly what a
    sampler without that memory samples."""
    model = load_model(str(model_dir)).model
    rng = np.random.default_rng(9)
    t1 = rng.integers(4, VOCAB, 20).tolist()
    t2 = t1 + rng.integers(4, VOCAB, 15).tolist()
    t3 = t2 + rng.integers(4, VOCAB, 10).tolist()
    long = rng.integers(4, VOCAB, 90).tolist()  # three 32-token chunks
    more = long + rng.integers(4, VOCAB, 7).tolist()
    requests = [("t1", t1), ("t2", t2), ("t3", t3), ("long", long), ("long-again", long), ("long-more", more)]

    def sample(prefix_cache_bytes: int) -> tuple[dict, dict]:
        sampler = make_sampler(model, model_dir, prefix_cache_bytes=prefix_cache_bytes, prefill_chunk_tokens=32)
        out = {}
        for key, p in requests:  # one admission each, as the turns of a conversation arrive
            out.update(run(sampler, [task(key, p, max_tokens=6, temperature=1.0, seed=7, stop=[], n=2)]))
        return out, sampler.stats

    want, plain = sample(0)
    got, stats = sample(1 << 30)
    assert plain["prefill_tokens"] == sum(len(p) for _, p in requests)
    assert stats["prefill_tokens"] == 20 + 15 + 10 + 90 + 0 + 7
    assert stats["cached_prompt_tokens"] == 20 + 35 + 90 + 90
    for key in want:
        for w, g in zip(want[key].sequences, got[key].sequences):
            np.testing.assert_array_equal(w.tokens, g.tokens)
            np.testing.assert_allclose(w.logprobs, g.logprobs, atol=1e-5, rtol=0)
