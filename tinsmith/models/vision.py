"""Images into a vision-language model: the processor's tokens, the vision tower's features, M-RoPE.

An image in a model input becomes ``count`` copies of the model's image token, where ``count``
is what the checkpoint's own image processor says (patch size, merge size, min/max pixels);
the frozen vision tower (transformers' own encoder of the family, :data:`TOWERS`) turns the
processor's patches into one embedding per copy, plus DeepStack features where the family has
them (Qwen3-VL; Qwen3.5's tower has none). Positions follow Qwen3-VL's ``get_rope_index``:
text runs count up on all three axes; an image's tokens sit on a (temporal, height, width) grid
starting at the running position, which then moves on by ``max(height, width)`` merged patches.
"""

from __future__ import annotations

import importlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tinsmith.models.config import VisionConfig
from tinsmith.models.layers import VisualFeatures
from tinsmith.types import ImageInput


# VisionConfig.tower -> (transformers module, its vision config class, its vision encoder class).
TOWERS = {
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeVisionConfig",
                    "Qwen3_5MoeVisionModel"),
}


def tower_classes(tower: str) -> tuple[type, type]:
    """The vision config and encoder classes of ``tower`` (imported when first needed)."""
    module, config_cls, model_cls = TOWERS[tower]
    m = importlib.import_module(module)
    return getattr(m, config_cls), getattr(m, model_cls)


@dataclass
class EncodedImage:
    """One image as the decoder sees it: ``embeds`` (n, hidden), ``deepstack`` [(n, hidden)]."""

    grid: tuple[int, int, int]  # (t, h, w) in patches, before merging
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])


class VisionTower:
    """The checkpoint's image processor and frozen vision encoder."""

    def __init__(self, cfg: VisionConfig, model_dir: Path, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype):
        # From its module: transformers 5.17's lazy top-level name wrongly demands torchvision.
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        self.cfg = cfg
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        config_cls, model_cls = tower_classes(cfg.tower)
        config = config_cls(**json.loads(cfg.raw_json))
        config._attn_implementation = "sdpa"
        model = model_cls(config)
        model.load_state_dict(weights, strict=True)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype

    def to(self, device: torch.device) -> VisionTower:
        """Move the encoder to ``device`` (a tensor-parallel rank loads on the host, then moves)."""
        self.model = self.model.to(device)
        self.device = device
        return self

    def num_tokens(self, width: int, height: int) -> int:
        """Image tokens for an image of this size: the processor's patch count over merge_size**2."""
        patches = self.processor.get_number_of_image_patches(height, width, {})
        return int(patches) // (self.cfg.merge_size ** 2)

    @torch.no_grad()
    def encode(self, images: list[ImageInput]) -> list[EncodedImage]:
        if not images:
            return []
        pil = [Image.open(io.BytesIO(im.data)).convert("RGB") for im in images]
        batch = self.processor(images=pil, return_tensors="pt")
        grid = batch["image_grid_thw"].to(self.device)
        out = self.model(batch["pixel_values"].to(self.device, self.dtype), grid_thw=grid)
        # transformers 5 returns a ModelOutput (Qwen3.5's without DeepStack features); 4.57 returned
        # (merged, deepstack).
        if isinstance(out, tuple):
            merged, deepstack = out[0], out[1]
        else:
            merged, deepstack = out.pooler_output, getattr(out, "deepstack_features", None) or []
        sizes = (grid.prod(-1) // self.cfg.merge_size ** 2).tolist()
        embeds = merged.split(sizes)
        layers = [feat.split(sizes) for feat in deepstack]
        return [EncodedImage(grid=tuple(int(x) for x in grid[i].tolist()), embeds=embeds[i],
                             deepstack=[layer[i] for layer in layers]) for i in range(len(images))]

    def batch_inputs(self, tokens: torch.Tensor, lengths: list[int],
                     images: list[list[ImageInput]]) -> tuple[torch.Tensor, VisualFeatures | None, list[int]]:
        """What a right-padded ``(b, L)`` batch needs for its images: ``(3, b, L)`` positions, the
        visual features, and each row's rope delta. ``images[i]`` are row ``i``'s images, their
        ``position`` the start of their tokens in the (expanded) row."""
        b, L = tokens.shape
        positions = torch.arange(L, device=tokens.device).expand(3, b, L).clone()
        flat = [im for row in images for im in row]
        if not flat:
            return positions, None, [0] * b
        encoded = self.encode(flat)
        deltas, k = [], 0
        for i, row in enumerate(images):
            enc, k = encoded[k:k + len(row)], k + len(row)
            if not row:
                deltas.append(0)
                continue
            pos, delta = mrope_positions(lengths[i], [im.position for im in row], [e.grid for e in enc],
                                         self.cfg.merge_size)
            positions[:, i, :lengths[i]] = torch.from_numpy(pos).to(tokens.device)
            deltas.append(delta)
        valid = torch.arange(L, device=tokens.device)[None, :] < torch.tensor(lengths, device=tokens.device)[:, None]
        mask = (tokens == self.cfg.image_token_id) & valid
        embeds = torch.cat([e.embeds for e in encoded])
        if int(mask.sum()) != embeds.shape[0]:
            raise RuntimeError(f"{int(mask.sum())} image tokens in the batch but its images make {embeds.shape[0]}")
        deepstack = [torch.cat(layer) for layer in zip(*[e.deepstack for e in encoded])]
        return positions, VisualFeatures(mask=mask, embeds=embeds, deepstack=deepstack), deltas


def expand_tokens(tokens: np.ndarray, images: list[ImageInput], counts: list[int],
                  image_token_id: int) -> tuple[np.ndarray, list[int]]:
    """The model's token sequence, each image as ``count`` image tokens at its place among the
    text tokens (``ImageInput.position``); and where each image's tokens start in it."""
    parts, starts, prev, added = [], [], 0, 0
    for im, n in zip(images, counts):
        parts += [tokens[prev:im.position], np.full(n, image_token_id, dtype=np.int64)]
        starts.append(im.position + added)
        prev, added = im.position, added + n
    parts.append(tokens[prev:])
    return np.concatenate(parts).astype(np.int64), starts


def mrope_positions(length: int, starts: list[int], grids: list[tuple[int, int, int]],
                    merge_size: int) -> tuple[np.ndarray, int]:
    """(3, length) multimodal positions of an expanded sequence whose images' tokens start at
    ``starts`` (``grids`` from the processor, in patches), and its ``rope_delta``
    (``max position + 1 - length``: what decoding adds to each new token's index)."""
    cols, cur, prev = [], 0, 0
    for start, (t, gh, gw) in zip(starts, grids):
        text = start - prev
        cols.append(np.broadcast_to(np.arange(cur, cur + text), (3, text)))
        cur += text
        h, w = gh // merge_size, gw // merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        cols.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur)
        cur += max(h, w)
        prev = start + t * h * w
    text = length - prev
    cols.append(np.broadcast_to(np.arange(cur, cur + text), (3, text)))
    pos = np.concatenate(cols, axis=1).astype(np.int64)
    return pos, int(pos.max()) + 1 - length if pos.size else 0
