"""Qwen3-VL: tinsmith's decoder (M-RoPE, DeepStack) with the vision tower, against transformers."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # not transformers.AutoImageProcessor: 5.17 demands torchvision there
from PIL import Image

from tinsmith.models.layers import VisualFeatures
from tinsmith.models.loading import load_model
from tinsmith.models.vision import expand_tokens, mrope_positions
from tinsmith.types import ImageInput


@pytest.fixture(scope="module")
def vl_dir(qwen3_vl_dir):
    return qwen3_vl_dir


def image(width: int, height: int, position: int, seed: int = 0) -> ImageInput:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return ImageInput(data=buf.getvalue(), format="png", width=width, height=height, position=position,
                      expected_tokens=None, where="prompt.chunks[1]")


def ours(loaded, text: np.ndarray, images: list[ImageInput]):
    """tinsmith's logits for a text with images, and the expanded tokens and rope delta."""
    vt, cfg = loaded.vision, loaded.config.vision
    enc = vt.encode(images)
    assert [e.num_tokens for e in enc] == [vt.num_tokens(im.width, im.height) for im in images]
    tokens, starts = expand_tokens(text, images, [e.num_tokens for e in enc], cfg.image_token_id)
    pos, delta = mrope_positions(len(tokens), starts, [e.grid for e in enc], cfg.merge_size)
    t = torch.tensor(tokens)[None]
    visual = VisualFeatures(mask=t == cfg.image_token_id, embeds=torch.cat([e.embeds for e in enc]),
                            deepstack=[torch.cat(f) for f in zip(*[e.deepstack for e in enc])])
    with torch.no_grad():
        logits = loaded.model.logits(loaded.model.hidden_states(t, torch.tensor(pos)[:, None, :], visual=visual))
    return logits[0], tokens, delta


def reference(vl_dir, tokens: np.ndarray, images: list[ImageInput]):
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(vl_dir)
    batch = proc(images=[Image.open(io.BytesIO(im.data)).convert("RGB") for im in images], return_tensors="pt")
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                    mm_token_type_ids=(ids == model.config.image_token_id).int())
    return model, out.logits[0], model.model.rope_deltas


def test_logits_with_images_match_transformers(vl_dir):
    loaded = load_model(str(vl_dir))
    assert loaded.config.family == "qwen3_vl" and loaded.config.rope.mrope_section
    cfg = loaded.config.vision
    text = np.array([10, 11, cfg.vision_start_token_id, 300, 12, cfg.vision_start_token_id, 13, 14, 15], dtype=np.int64)
    images = [image(70, 50, position=3, seed=1), image(40, 90, position=6, seed=2)]
    logits, tokens, delta = ours(loaded, text, images)
    assert (tokens == cfg.image_token_id).sum() > 4
    _, expected, ref_delta = reference(vl_dir, tokens, images)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert delta == int(ref_delta[0, 0]) and delta < 0


def test_text_only_prompt_on_a_vl_model_matches_transformers(vl_dir):
    loaded = load_model(str(vl_dir))
    tokens = torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(0))
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(input_ids=tokens).logits
        got = loaded.model.logits(loaded.model.hidden_states(tokens, torch.arange(40).expand(2, 40)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_batch_with_and_without_images_equals_each_row_alone(vl_dir):
    """VisionTower.batch_inputs: right-padded rows, some with images, each as if it ran alone."""
    loaded = load_model(str(vl_dir))
    vt, cfg = loaded.vision, loaded.config.vision
    text = np.array([10, 11, cfg.vision_start_token_id, 12, 13], dtype=np.int64)
    images = [image(70, 50, position=3, seed=1), image(33, 40, position=5, seed=4)]
    expanded, starts = expand_tokens(text, images, [vt.num_tokens(im.width, im.height) for im in images],
                                     cfg.image_token_id)
    placed = [ImageInput(**{**im.__dict__, "position": s}) for im, s in zip(images, starts)]
    plain = np.array([20, 21, 22], dtype=np.int64)
    L = len(expanded)
    tokens = torch.zeros(2, L, dtype=torch.long)
    tokens[0, : len(plain)] = torch.tensor(plain)
    tokens[1] = torch.tensor(expanded)
    positions, visual, deltas = vt.batch_inputs(tokens, [len(plain), L], [[], placed])
    with torch.no_grad():
        logits = loaded.model.logits(loaded.model.hidden_states(tokens, positions, visual=visual))
    alone, _, delta = ours(loaded, text, images)
    torch.testing.assert_close(logits[1], alone, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        plain_alone = loaded.model.logits(loaded.model.hidden_states(torch.tensor(plain)[None], torch.arange(3)[None]))
    torch.testing.assert_close(logits[0, :3], plain_alone[0], atol=1e-5, rtol=1e-5)
    assert deltas == [0, delta]


def _saved_random_adapter(loaded, directory, base: str, seed: int):
    """A rank-2 adapter with random A and B on every target of ``loaded``, saved as PEFT under the
    VL class's module names; then merged into ``loaded``'s own weights (ours, as adapted).
    Returns its tensors and the generator, for more draws."""
    from tinsmith.checkpoints.peft_format import save_peft_adapter
    from tinsmith.types import LoraSpec

    spec = LoraSpec(rank=2, seed=0, alpha=4.0, train_attn=True, train_mlp=True, train_unembed=True)
    g = torch.Generator().manual_seed(seed)
    targets = loaded.model.lora_targets(True, True, True)
    tensors = {}
    for name, layer in targets:
        tensors[f"{name}.lora_A.weight"] = torch.randn(2, layer.in_features, generator=g) * 0.1
        tensors[f"{name}.lora_B.weight"] = torch.randn(layer.out_features, 2, generator=g) * 0.1
    save_peft_adapter(directory, spec, tensors, base, text_prefix=loaded.config.text_prefix)
    with torch.no_grad():
        for name, layer in targets:
            layer.weight += (spec.alpha / spec.rank) * tensors[f"{name}.lora_B.weight"] @ tensors[f"{name}.lora_A.weight"]
    return tensors, g


def test_peft_adapter_of_a_vl_base_loads_into_transformers(vl_dir, tmp_path):
    """Adapters of a Qwen3-VL base carry the VL class's module names, so PEFT applies them."""
    from peft import PeftModel

    from tinsmith.checkpoints.peft_format import load_peft_adapter

    loaded = load_model(str(vl_dir))
    tensors, g = _saved_random_adapter(loaded, tmp_path / "adapter", "vl", seed=0)
    back_spec, back = load_peft_adapter(tmp_path / "adapter")
    assert back.keys() == tensors.keys() and back_spec.rank == 2
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    ref = PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    tokens = torch.randint(0, 400, (1, 24), generator=g)
    with torch.no_grad():
        expected = ref(input_ids=tokens).logits
        base = transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32)(input_ids=tokens).logits
        got = loaded.model.logits(loaded.model.hidden_states(tokens, torch.arange(24)[None]))
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the model
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_merged_export_of_a_vl_adapter_is_a_whole_vl_checkpoint(vl_dir, tmp_path):
    """``tinsmith export --format merged`` of a Qwen3-VL adapter: the decoder's weights merged under
    the VL class's names, the vision tower and processor configs as the base's; transformers'
    class loads it with nothing missing and gives our adapted logits, with an image too."""
    from safetensors import safe_open

    from tinsmith.checkpoints.export import export_merged
    from tinsmith.models.loading import weight_files

    loaded = load_model(str(vl_dir))
    _saved_random_adapter(loaded, tmp_path / "adapter", str(vl_dir), seed=1)
    merged = export_merged(tmp_path / "adapter", tmp_path / "merged", str(vl_dir)).path
    assert (merged / "preprocessor_config.json").is_file()
    base_files, merged_files = weight_files(vl_dir), weight_files(merged)
    assert "lm_head.weight" in merged_files and base_files.keys() <= merged_files.keys()
    tower = [n for n in base_files if n.startswith("model.visual.")]
    with safe_open(str(base_files[tower[0]]), framework="pt") as a, safe_open(str(merged_files[tower[0]]), framework="pt") as b:
        assert all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in tower)
    _, info = transformers.Qwen3VLForConditionalGeneration.from_pretrained(merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    images = [image(64, 48, position=3)]
    start = loaded.config.vision.vision_start_token_id
    text = np.array([10, 11, start, 300, 12, 13, 14], dtype=np.int64)
    logits, tokens, _ = ours(loaded, text, images)
    _, expected, _ = reference(merged, np.asarray(tokens), images)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
