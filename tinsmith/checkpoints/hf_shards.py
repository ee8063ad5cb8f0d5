"""Write a state dict the way ``transformers``' ``save_pretrained`` does: safetensors shards
``model-00001-of-0000N.safetensors`` of at most ``max_shard_size`` each plus
``model.safetensors.index.json`` (a single ``model.safetensors`` when everything fits in one).

The split is planned on shapes and dtypes alone (meta tensors) with ``huggingface_hub``'s
``split_torch_state_dict_into_shards``, the function ``transformers`` uses, and each tensor is
made only when its shard is written: exporting an 8B model never holds more than one shard of
it in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from tinsmith.progress import bar
from tinsmith.errors import InvalidInputError

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' and huggingface_hub's default


def shard_size(value: str | int) -> str | int:
    """A ``--max-shard-size`` as huggingface_hub reads it (``"5GB"``, ``"500MB"``, or bytes),
    checked before any work is done: a plain number becomes bytes, anything else is refused."""
    text = str(value).strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    try:
        if not text.startswith("-"):
            split_torch_state_dict_into_shards({}, max_shard_size=text)  # parses the size, nothing else
            return text
    except ValueError:
        pass
    raise InvalidInputError(f"--max-shard-size {value!r} is not a size like 5GB, 500MB or a byte count")


def write_shards(out_dir: Path, plan: dict[str, torch.Tensor], make: Callable[[str], torch.Tensor],
                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, show_progress: bool = False) -> list[str]:
    """Write the tensors named in ``plan`` (meta tensors: name -> shape and dtype, in file order)
    to ``out_dir``; ``make(name)`` returns the real tensor, which must match its plan entry.
    Returns the files written (the shards, then the index when there is one)."""
    split = split_torch_state_dict_into_shards(plan, max_shard_size=shard_size(max_shard_size))
    written = []
    total_bytes = sum(t.numel() * t.element_size() for t in plan.values())
    with bar(show_progress, total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
             desc="merging and writing") as pbar:
        for filename, names in split.filename_to_tensors.items():
            pbar.set_postfix_str(filename, refresh=False)
            shard = {}
            for name in names:
                t = make(name).detach().contiguous().cpu()
                want = plan[name]
                if t.shape != want.shape or t.dtype != want.dtype:
                    raise AssertionError(f"{name}: made {tuple(t.shape)} {t.dtype}, "
                                         f"planned {tuple(want.shape)} {want.dtype}")
                shard[name] = t
                pbar.update(t.numel() * t.element_size())
            save_file(shard, str(out_dir / filename), metadata={"format": "pt"})
            written.append(filename)
            del shard
    if split.is_sharded:
        # transformers' layout: total_parameters next to huggingface_hub's total_size, sorted keys
        total_parameters = sum(t.numel() for t in plan.values())
        index = {"metadata": {"total_parameters": total_parameters, **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX)
    return written
