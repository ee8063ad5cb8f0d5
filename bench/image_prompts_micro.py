"""Micro-benchmark: GRPO's separate sample requests of prompts with an image, in one sampler.

RL on an image-text model sends each prompt (text around an image) as ``--samples`` separate
requests, as the cookbook does, and they reach the sampler over several scheduler steps. This
queues ``--prompts`` such prompts' requests in ``--waves`` waves (one sampler step between
waves: later requests of a prompt meet its earlier ones already running) on a tiny image-text
model, runs them to the end, and prints the wall time, the prefills and prompt tokens computed,
and the images the vision tower encoded. The same requests as one ``num_samples`` request per
prompt are the reference. Each kind runs ``--repeats`` times on a fresh sampler; medians.

    python bench/image_prompts_micro.py [--family qwen3_vl|qwen3_5_vl] [--prompts 4] [--samples 16]
        [--waves 4] [--max-tokens 32] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinsmith.devtools.tiny_model import TinyShape, make_tiny_model  # noqa: E402
from tinsmith.models.loading import load_model  # noqa: E402
from tinsmith.models.vision import expand_tokens  # noqa: E402
from tinsmith.sampling.sampler import Sampler, SampleTask  # noqa: E402
from tinsmith.types import ImageInput, SampleInput, SamplingParams  # noqa: E402


def image_prompt(loaded, seed: int) -> tuple[np.ndarray, list[ImageInput]]:
    """Twelve text tokens, an image of 96 x 64 pixels, eight more: expanded to its image tokens."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(buf, "PNG")
    vision, cfg = loaded.vision, loaded.config.vision
    text = np.concatenate([rng.integers(10, 300, 12), [cfg.vision_start_token_id], rng.integers(10, 300, 8)])
    im = ImageInput(data=buf.getvalue(), format="png", width=96, height=64, position=13, expected_tokens=None,
                    where="prompt.chunks[1]")
    expanded, starts = expand_tokens(text, [im], [vision.num_tokens(96, 64)], cfg.image_token_id)
    return np.asarray(expanded), [ImageInput(**{**im.__dict__, "position": starts[0]})]


def run_once(loaded, prompts: list, samples: int, waves: int, max_tokens: int, separate: bool) -> dict:
    sampler = Sampler(loaded.model, lambda ids: "", vision=loaded.vision)
    encoded = []
    encode = loaded.vision.encode
    loaded.vision.encode = lambda ims: encoded.append(len(ims)) or encode(ims)
    try:
        tasks: list[list[SampleTask]] = [[] for _ in range(waves if separate else 1)]
        for p, (tokens, images) in enumerate(prompts):
            if not separate:
                params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=p, stop=[])
                tasks[0].append(SampleTask((p, 0), None, SampleInput(tokens, samples, params, prompt_images=images)))
                continue
            for s in range(samples):
                params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=p * samples + s, stop=[])
                tasks[s * waves // samples].append(SampleTask((p, s), None, SampleInput(tokens, 1, params,
                                                                                        prompt_images=images)))
        t0 = time.perf_counter()
        done = 0
        for wave in tasks:
            for t in wave:
                sampler.add(t)
            done += len(sampler.step(0.0))  # one scheduler step before the next wave arrives
        while sampler.has_work():
            done += len(sampler.step(3600.0))
        wall = time.perf_counter() - t0
    finally:
        loaded.vision.encode = encode
    return {"wall_s": wall, "prefills": sampler.stats["prefills"], "prefill_tokens": sampler.stats["prefill_tokens"],
            "images_encoded": sum(encoded)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("qwen3_vl", "qwen3_5_vl"), default="qwen3_vl")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    out: dict = {"torch": torch.__version__, "args": vars(args)}
    with tempfile.TemporaryDirectory() as d:
        shape = TinyShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
        loaded = load_model(str(make_tiny_model(Path(d) / "m", args.family, shape, seed=1)), "cpu", torch.float32)
        prompts = [image_prompt(loaded, seed) for seed in range(args.prompts)]
        for kind, separate in (("separate", True), ("num_samples", False)):
            runs = [run_once(loaded, prompts, args.samples, args.waves, args.max_tokens, separate)
                    for _ in range(args.repeats)]
            out[kind] = r = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            print(f"{kind:>11}: {1e3 * r['wall_s']:8.1f} ms, prefills {r['prefills']:.0f}, prompt tokens computed "
                  f"{r['prefill_tokens']:.0f}, images encoded {r['images_encoded']:.0f}", flush=True)
    out["separate_over_num_samples_speed"] = out["num_samples"]["wall_s"] / out["separate"]["wall_s"]
    print(f"separate requests / num_samples (speed): {out['separate_over_num_samples_speed']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
