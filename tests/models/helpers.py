"""What the model-family tests share: transformers' reference model and loss, our logits, adapters
with non-zero B, one training call, and the checks every family runs the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.worker.helpers import assert_rel_close
from tinsmith.models.loading import load_model
from tinsmith.types import ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainingRuntime, TrainRequest


def reference_model(model_dir):
    """transformers' model in fp32; eager experts are its reference loop (grouped kernels reorder sums)."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                             experts_implementation="eager")


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """Our model's logits for ``tokens`` (b, L) at positions 0..L-1, base weights only."""
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model.logits(model.hidden_states(tokens, pos))


def cross_entropy_step(rt, unit, data):
    """One cross_entropy forward_backward of ``data`` on ``unit``; its result (raised if it failed)."""
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput(data, "cross_entropy", {}, False))])
    if isinstance(res, Exception):
        raise res
    return res


def ref_loss(ref, data):
    """transformers' summed weighted cross-entropy over ``data`` (backward run) and its per-token logprobs."""
    total, lps = 0.0, []
    for d in data:
        lp = torch.log_softmax(ref(torch.from_numpy(d.tokens)[None]).logits[0].float(), -1)
        lp = lp.gather(-1, torch.from_numpy(d.loss_inputs["target_tokens"])[:, None])[:, 0]
        loss = -(lp * torch.from_numpy(d.loss_inputs["weights"])).sum()
        loss.backward()
        total += float(loss.detach())
        lps.append(lp.detach().numpy())
    return total, lps


def perturbed_adapter(rt, spec, seed):
    """A new adapter on ``rt`` with random ``lora_B`` (zero at init), so that it changes the outputs."""
    u = rt.create_adapter(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in rt.unit(u).named_params:
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return u


def peft_grads_per_expert(peft_model, num_experts: int, rank: int) -> dict[str, torch.Tensor]:
    """peft's gradients under our names; fused expert LoRA (see peft's PeftConcatenate) taken apart.

    gate_up_proj's adapter is rank 2r: A = [A_gate; A_up] per expert, B block-diagonal, columns
    ordered (rank, expert). down_proj's is rank r with the same column order.
    """
    out = {}
    for n, p in peft_model.named_parameters():
        if p.grad is None:
            continue
        n = n.replace("base_model.model.", "").replace(".default", "")
        g = p.grad
        if ".mlp.experts.base_layer.lora_" in n:  # gate_up_proj (the inner wrapper)
            prefix = n.split(".base_layer.")[0]
            if ".lora_A." in n:
                a = g.reshape(num_experts, 2 * rank, -1)
                out[f"{prefix}.gate_proj.lora_A.weight"], out[f"{prefix}.up_proj.lora_A.weight"] = a[:, :rank], a[:, rank:]
            else:
                b = g.reshape(g.shape[0], 2 * rank, num_experts).permute(2, 0, 1)  # experts, 2I, 2r
                half = b.shape[1] // 2
                out[f"{prefix}.gate_proj.lora_B.weight"] = b[:, :half, :rank]
                out[f"{prefix}.up_proj.lora_B.weight"] = b[:, half:, rank:]
        elif ".mlp.experts.lora_" in n:  # down_proj (the outer wrapper)
            prefix, kind = n.split(".lora_")
            if kind.startswith("A"):
                out[f"{prefix}.down_proj.lora_A.weight"] = g.reshape(num_experts, rank, -1)
            else:
                out[f"{prefix}.down_proj.lora_B.weight"] = g.reshape(g.shape[0], rank, num_experts).permute(2, 0, 1)
        else:
            out[n] = g
    return out


def logits_with(model, tokens: torch.Tensor, rows) -> torch.Tensor:
    """Our model's logits for ``tokens`` (b, L) at positions 0..L-1, with the adapters of ``rows``."""
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model.logits(model.hidden_states(tokens, pos, rows), rows)


def assert_merged_export_matches(rt, unit, merged, vocab: int) -> torch.Tensor:
    """transformers, loading the merged export at ``merged``, gives the logits ``unit`` gives on ``rt``
    (two random rows of 30 tokens); returns those tokens."""
    tokens = torch.randint(0, vocab, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = logits_with(rt.model, tokens, [(rt.unit(unit).slot, 0, 60)])
        torch.testing.assert_close(reference_model(merged).eval()(tokens).logits, ours, rtol=1e-4, atol=1e-4)
    return tokens


def drop_packed_gate_up(layer) -> None:
    """Make an MoE layer's experts run gate and up as separate projections."""
    layer.mlp.experts.packed_gate_up = None


def assert_packed_equals_separate(rt, units, seq_len: int, vocab: int, unpack) -> None:
    """Two tenants' rows through the packed inference projections give the logits the separate
    projections give once ``unpack(layer)`` has dropped each layer's packed buffer."""
    model = rt.model
    tokens = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(8))
    rows = [(rt.unit(units[0]).slot, 0, seq_len), (rt.unit(units[1]).slot, seq_len, 2 * seq_len)]
    with torch.no_grad():
        packed = logits_with(model, tokens, rows)
        for layer in model.model.layers:
            unpack(layer)
        separate = logits_with(model, tokens, rows)
    # one GEMM against several: fp32 sums in other orders (up to 2e-5 seen on AVX2 CPUs)
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=5e-5)


def assert_micro_batching_equals_plain(model_dir, data) -> None:
    """Micro-batches and gradient checkpointing give the plain step's logprobs and adapter grads."""
    results = []
    for kwargs in ({}, {"micro_batch_tokens": 64}, {"gradient_checkpointing": True}):
        rt = TrainingRuntime(load_model(str(model_dir)).model, **kwargs)
        u = perturbed_adapter(rt, LoraSpec(rank=4, seed=9), 9)
        results.append((cross_entropy_step(rt, u, data), {n: p.grad for n, p in rt.unit(u).named_params}))
    (ref, ref_g), rest = results[0], results[1:]
    for res, g in rest:
        for x, y in zip(res.outputs, ref.outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-6)
        for n in ref_g:
            assert_rel_close(g[n], ref_g[n], 1e-5, n)


def assert_step_matches_peft(rt, unit, res, ref, data, rank: int, grads_of=peft_grads_per_expert) -> None:
    """``res`` (our cross_entropy step of ``data`` on ``unit``) has the logprobs and loss that the peft
    model ``ref`` gives, and every LoRA gradient equals peft's as ``grads_of`` names them."""
    total, lps = ref_loss(ref, data)
    for lp, out in zip(lps, res.outputs):
        np.testing.assert_allclose(out["logprobs"], lp, rtol=1e-5, atol=1e-5)
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    theirs = grads_of(ref, 4, rank)
    ours = {n: p.grad for n, p in rt.unit(unit).named_params}
    assert set(ours) == set(theirs)
    for n, g in ours.items():
        assert_rel_close(g, theirs[n], 1e-4, n)
