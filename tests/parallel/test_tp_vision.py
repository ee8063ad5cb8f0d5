"""An image-text model (Qwen3-VL, and Qwen3.5's hybrid decoder) over 2 gloo ranks gives what one
process gives, within 1e-5: logprobs and LoRA gradients of a datum with an image, and sampled
tokens of a prompt with one. The decoder is sharded; the frozen vision tower runs whole on every
rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.test_qwen3_vl import image
from tests.parallel.scenario import assert_same
from tinsmith.models.loading import load_model
from tinsmith.models.vision import expand_tokens
from tinsmith.parallel.group import TPGroup
from tinsmith.parallel.launch import run_ranks
from tinsmith.types import Datum, ForwardBackwardInput, ImageInput, LoraSpec, SampleInput, SamplingParams


def _with_image(vision, cfg, seed: int) -> tuple[np.ndarray, list[ImageInput]]:
    """Text tokens around one image, expanded to its image tokens; the image placed at its start."""
    rng = np.random.default_rng(seed)
    text = np.concatenate([rng.integers(4, 300, 5), [cfg.vision_start_token_id], rng.integers(4, 300, 4)])
    im = image(40, 30, position=6, seed=seed)
    expanded, starts = expand_tokens(text, [im], [vision.num_tokens(im.width, im.height)], cfg.image_token_id)
    return np.asarray(expanded, dtype=np.int64), [ImageInput(**{**im.__dict__, "position": starts[0]})]


def vision_scenario(model_dir: str, tp: TPGroup | None) -> dict:
    from tinsmith.parallel.runtime import TPTrainingRuntime
    from tinsmith.parallel.sampling import ShardedSampler
    from tinsmith.parallel.shard import shard_causal_lm
    from tinsmith.sampling.sampler import Sampler, SampleTask
    from tinsmith.worker.runtime import TrainingRuntime, TrainRequest

    loaded = load_model(model_dir, "cpu", torch.float32)
    model, vision, cfg = loaded.model, loaded.vision, loaded.config.vision
    if tp is not None:
        shard_causal_lm(model, tp)
        rt, sampler = TPTrainingRuntime(model, vision=vision), ShardedSampler(model, lambda ids: "", vision=vision)
    else:
        rt, sampler = TrainingRuntime(model, vision=vision), Sampler(model, lambda ids: "", vision=vision)
    unit = rt.create_adapter(LoraSpec(rank=4, seed=5))
    tokens, images = _with_image(vision, cfg, seed=1)
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)},
                  images=images)
    (res,) = rt.forward_backward([TrainRequest(unit, ForwardBackwardInput([datum], "cross_entropy"))])
    grads = rt.full_grads(unit) if tp is not None else {n: p.grad.clone() for n, p in rt.unit(unit).named_stepped}
    prompt, prompt_images = _with_image(vision, cfg, seed=2)
    slot = rt.unit(unit).slot
    for key, params in (("greedy", SamplingParams(max_tokens=5, temperature=0.0, stop=[])),
                        ("seeded", SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[]))):
        sampler.add(SampleTask(key, slot, SampleInput(prompt, 2, params, prompt_images=prompt_images)))
    sampled = {}
    while sampler.has_work():
        for key, r in sampler.step(budget_s=3600.0):  # no time budget: every rank runs the same steps
            if isinstance(r, Exception):
                raise r
            sampled[key] = [torch.from_numpy(s.tokens.astype(np.int64)) for s in r.sequences]
    return {"logprobs": res.outputs[0]["logprobs"], "grads": grads, "sampled": sampled}


def vision_rank_main(tp: TPGroup, model_dir: str) -> dict:
    return vision_scenario(model_dir, tp)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5_vl"])
def test_an_image_text_model_over_two_ranks_matches_one_process(family, request, tmp_path):
    model_dir = request.getfixturevalue(f"{family}_dir")
    ref = vision_scenario(str(model_dir), None)
    outcomes = run_ranks(vision_rank_main, 2, tmp_path, (str(model_dir),), timeout_s=60, deadline_s=180)
    for o in outcomes:
        assert o.exitcode == 0, f"rank {o.rank} failed:\n{o.error}"
    assert not torch.equal(ref["sampled"]["seeded"][0], ref["sampled"]["seeded"][1])  # really sampled
    for o in outcomes:
        assert_same(ref, o.result, f"rank {o.rank}")
