"""A full fine-tune's Hugging Face export (``save_weights_for_sampler``, ``save_weights_external``)
and its reload as stored sampler weights, for every family's checkpoint layout: experts stored
one tensor each (Qwen3-MoE, Qwen3.5-MoE) or fused (gpt-oss), and an image-text checkpoint whose
decoder sits under ``model.language_model.`` beside a vision tower and multi-token-prediction
weights that a full fine-tune never trains (released Qwen3.5 checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.models.helpers import logits_of
from tests.models.test_qwen3_5 import _image_text_checkpoint
from tinsmith.checkpoints.export import hf_model_bytes, save_hf_model
from tinsmith.models.loading import load_model, weight_files
from tinsmith.sampling.sampler import SampleTask
from tinsmith.types import SampleInput, SamplingParams
from tinsmith.worker.runtime import FULL_UNIT
from tinsmith.worker.service import RuntimeOptions, Worker

_GREEDY = SampleInput(np.arange(3, 11), 1, SamplingParams(max_tokens=10, temperature=0.0, stop=[]))


def _trained_full_run(model_dir) -> Worker:
    """A one-process worker holding full fine-tune "full" of ``model_dir``, every weight moved
    off the base's (as an optimizer step would: in place)."""
    w = Worker(RuntimeOptions(device="cpu", dtype="float32", max_full_sampler_snapshots=4))
    w.add_base_model("m", str(model_dir))
    w.create_model("full", "m", None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in w.placement("full").runtime.unit(FULL_UNIT).named_params:
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return w


def _greedy(w: Worker, key: str) -> tuple[np.ndarray, np.ndarray]:
    snap = w.snapshots[key]
    assert w.make_resident(snap)
    sampler = w.sampler(snap.base, snap)
    sampler.add(SampleTask(key, None, _GREEDY))
    while sampler.has_work():
        for _, res in sampler.step(3600.0):
            assert not isinstance(res, Exception), res
            return res.sequences[0].tokens, res.sequences[0].logprobs
    raise AssertionError("nothing sampled")


def _tensor_bytes(directory) -> int:
    total = 0
    for f in set(weight_files(directory).values()):
        with safe_open(str(f), framework="pt") as fh:
            total += sum(fh.get_tensor(n).numel() * fh.get_tensor(n).element_size() for n in fh.keys())
    return total


@pytest.mark.parametrize("fixture", ["qwen3_dir", "qwen3_moe_dir", "gpt_oss_dir", "qwen3_5_moe_dir"])
def test_stored_sampler_weights_load_back_in_every_family_layout(request, fixture, tmp_path):
    """What a restart or an eviction does to a stored full snapshot: read back from its export, it
    samples what the in-memory snapshot of the same weights samples (the experts' layout on disk
    is not the one the run holds)."""
    w = _trained_full_run(request.getfixturevalue(fixture))
    weights, base = w.full_weights("full")
    size = save_hf_model(tmp_path / "export", weights, base.loaded.model_dir)
    assert hf_model_bytes(weights, base.loaded.model_dir) == _tensor_bytes(tmp_path / "export") <= size
    w.snapshot("full", "in-memory")
    w.load_snapshot("stored", "m", tmp_path / "export")
    (tokens, logprobs), (tokens2, logprobs2) = _greedy(w, "in-memory"), _greedy(w, "stored")
    np.testing.assert_array_equal(tokens, tokens2)
    np.testing.assert_allclose(logprobs, logprobs2, atol=1e-6, rtol=0)


def test_an_image_text_checkpoints_full_fine_tune_exports_a_whole_checkpoint_of_its_class(qwen3_5_dir, tmp_path):
    """The export names the decoder as the checkpoint does and carries the untrained vision tower and
    multi-token-prediction tensors, so transformers' image-text class loads it with nothing missing
    or unexpected and computes the run's logits; tinsmith reads it back as a base model and as
    stored sampler weights."""
    import transformers

    vl_dir, _ = _image_text_checkpoint(tmp_path, qwen3_5_dir)
    w = _trained_full_run(vl_dir)
    weights, base = w.full_weights("full")
    save_hf_model(tmp_path / "export", weights, base.loaded.model_dir)

    stored, exported = weight_files(vl_dir), weight_files(tmp_path / "export")
    assert exported.keys() == stored.keys()  # every tensor of the base's class, under its names
    untrained = [n for n in stored if n.startswith(("model.visual.", "mtp."))]
    assert untrained and any(n.startswith("mtp.") for n in untrained)
    with safe_open(str(stored[untrained[0]]), framework="pt") as a, \
            safe_open(str(exported[untrained[0]]), framework="pt") as b:
        assert all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in untrained)
    assert hf_model_bytes(weights, base.loaded.model_dir) == _tensor_bytes(tmp_path / "export")

    tokens = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = logits_of(w.placement("full").runtime.model, tokens)
        ref, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
            tmp_path / "export", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        torch.testing.assert_close(ref.eval()(input_ids=tokens).logits, ours, rtol=1e-5, atol=1e-4)
        again = load_model(str(tmp_path / "export")).model
        torch.testing.assert_close(logits_of(again, tokens), ours, rtol=1e-5, atol=1e-5)

    w.snapshot("full", "in-memory")
    w.load_snapshot("stored", "m", tmp_path / "export")
    assert np.array_equal(_greedy(w, "in-memory")[0], _greedy(w, "stored")[0])


def test_a_sharded_export_of_an_image_text_checkpoint_is_whole_too(qwen3_5_dir, tmp_path):
    """Under ``--data-parallel-size 2`` every rank writes its own tensors and rank 0 the untrained
    ones besides: the same tensors as one process's export, and the quota counts them all."""
    vl_dir, _ = _image_text_checkpoint(tmp_path, qwen3_5_dir)
    one = Worker(RuntimeOptions(device="cpu", dtype="float32"))
    one.add_base_model("m", str(vl_dir))
    one.create_model("full", "m", None)
    weights, base = one.full_weights("full")
    save_hf_model(tmp_path / "one", weights, base.loaded.model_dir)
    two = Worker(RuntimeOptions(device="cpu", dtype="float32", data_parallel_size=2))
    try:
        two.add_base_model("m", str(vl_dir))
        two.create_model("full", "m", None)
        assert two.sharded_weights_bytes("full") == _tensor_bytes(tmp_path / "one")
        two.save_full_weights_sharded("full", tmp_path / "two", (), "export")
    finally:
        two.close()
    a, b = weight_files(tmp_path / "one"), weight_files(tmp_path / "two")
    assert a.keys() == b.keys() == weight_files(vl_dir).keys()
    for n in a:
        with safe_open(str(a[n]), framework="pt") as fa, safe_open(str(b[n]), framework="pt") as fb:
            assert torch.equal(fa.get_tensor(n), fb.get_tensor(n)), n


@pytest.mark.parametrize("family,dp,tp", [("qwen3_vl", 2, 1), ("qwen3_vl", 1, 2), ("qwen3_5_vl", 2, 1)],
                         ids=["dp2", "tp2", "qwen3_5-dp2"])
def test_an_image_text_full_fine_tune_over_two_ranks_matches_one_process(family, request, tmp_path, dp, tp):
    """Over a group (two replicas, or two tensor-parallel ranks each reading the checkpoint again
    for the FSDP run) each rank runs the frozen vision tower on its share of the datums: a step on
    datums with images gives one process's logprobs and weights, a snapshot samples its greedy
    tokens after an image, and the sharded export is a whole image-text checkpoint."""
    import transformers

    from tests.parallel.test_tp_vision import _with_image
    from tinsmith.types import AdamParams, Datum, ForwardBackwardInput

    one = Worker(RuntimeOptions(device="cpu", dtype="float32", micro_batch_tokens=64))
    two = Worker(RuntimeOptions(device="cpu", dtype="float32", micro_batch_tokens=64, data_parallel_size=dp,
                                tensor_parallel_size=tp))
    try:
        results, states, sampled = [], [], []
        for w in (one, two):
            base = w.add_base_model("m", str(request.getfixturevalue(f"{family}_dir")))
            w.create_model("full", "m", None)
            vision, cfg = base.loaded.vision, base.loaded.config.vision
            data = []
            for seed in (1, 2, 3):  # two datums with an image for one replica, one for the other
                tokens, images = _with_image(vision, cfg, seed)
                data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:],
                                                "weights": np.ones(len(tokens) - 1, np.float32)}, images=images))
            p = w.fb_begin("full", [ForwardBackwardInput(data, "cross_entropy")])
            while not p.done:
                w.fb_advance([(p, 1 << 20)], 1 << 20)
            results.append(p.results[0])
            w.optim_step("full", AdamParams(learning_rate=1e-2))
            states.append(w.export_training_state("full").weights)
            prompt, prompt_images = _with_image(vision, cfg, seed=4)
            snap = w.snapshot("full", "snap")
            assert w.make_resident(snap)
            sampler = w.sampler(snap.base, snap)
            sampler.add(SampleTask("g", None, SampleInput(prompt, 1, SamplingParams(max_tokens=6, temperature=0.0,
                                                                                    stop=[]),
                                                          prompt_images=prompt_images)))
            while sampler.has_work():
                for _, res in sampler.step(3600.0):
                    assert not isinstance(res, Exception), res
                    sampled.append(res.sequences[0].tokens)
        for a, b in zip(results[0].outputs, results[1].outputs):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
        for n in states[0]:
            np.testing.assert_allclose(states[0][n].numpy(), states[1][n].numpy(), atol=1e-5, rtol=0, err_msg=n)
        np.testing.assert_array_equal(*sampled)
        two.save_full_weights_sharded("full", tmp_path / "export", (), "export")
    finally:
        two.close()
    cls = transformers.Qwen3VLForConditionalGeneration if family == "qwen3_vl" else transformers.Qwen3_5ForConditionalGeneration
    _, info = cls.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_an_earlier_export_with_its_decoder_stored_flat_still_loads_back(qwen3_5_dir, tmp_path):
    """Stored sampler weights written before exports took the checkpoint's layout (an image-text
    config beside decoder tensors named ``model.*``) are still read back as they were written."""
    from safetensors.torch import save_file

    vl_dir, _ = _image_text_checkpoint(tmp_path, qwen3_5_dir)
    w = _trained_full_run(vl_dir)
    weights, _ = w.full_weights("full")
    old = tmp_path / "old"
    old.mkdir()
    save_file({n: t.contiguous() for n, t in weights.items()}, str(old / "model.safetensors"))
    (old / "config.json").write_text((vl_dir / "config.json").read_text())
    w.snapshot("full", "in-memory")
    w.load_snapshot("stored", "m", old)
    np.testing.assert_array_equal(_greedy(w, "stored")[0], _greedy(w, "in-memory")[0])


def test_stored_sampler_weights_that_do_not_fit_are_refused_clearly(qwen3_dir, model_dirs, tmp_path):
    """Another model's weights, or an export whose config went missing: a 400 naming the
    directory, and nothing installed."""
    from tinsmith.errors import InvalidInputError

    w = _trained_full_run(qwen3_dir)
    weights, base = w.full_weights("full")
    save_hf_model(tmp_path / "export", weights, base.loaded.model_dir)
    (tmp_path / "export" / "config.json").unlink()
    for directory in (model_dirs["llama"], tmp_path / "export"):
        with pytest.raises(InvalidInputError, match="stored sampler weights at .* do not fit 'm'"):
            w.load_snapshot("stored", "m", directory)
    assert "stored" not in w.snapshots
