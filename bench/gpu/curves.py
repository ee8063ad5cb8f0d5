"""A real SFT run's loss curve: tinsmith's training path against transformers + peft, step by step.

Issue 14 asks that the training shortcuts change nothing but rounding: the loss curves of a real
SFT run equal before and after within bf16 noise. "Before" is the plain path the shortcuts replace:
transformers + peft, with one autograd op per LoRA product, fp32 logits over the whole vocabulary,
and torch's AdamW. "After" is the runtime as the server runs it: packed micro-batches sized from
free memory, several tenants' products grouped, fused nodes and kernels, chunked logprobs, fused
AdamW on fp32 masters.

Every run trains a LoRA adapter (rank 32, every linear layer and the unembedding, the SDK's
defaults) from the same initial weights, on the same data, with the same AdamW hyperparameters:

- ``tinsmith``: the runtime in the model's serving dtype (bf16 on a GPU);
- ``tinsmith_tenants``: the same adapter's run again, with other tenants' adapters in the same
  steps, each on its own data (the several-tenant path; the first tenant's curve is reported);
- ``peft``: the plain path in the same dtype;
- ``peft_fp32`` and ``tinsmith_fp32``: both paths in fp32, the reference, and tinsmith's own
  exactness in fp32.

bf16 noise is how far the plain path's own bf16 run strays from the fp32 reference: the largest
over steps of ``|loss - reference| / reference`` (at least 1e-4, so that a bf16 run that happens to
land on the reference does not make every other run "noisy"). The runtime's bf16 curves are
"within bf16 noise" when their own largest deviation is at most twice that (``noise_ratio`` <= 2):
two bf16 runs of one computation stray from the reference by amounts of that order, chaotically,
and step by step. (A step's loss averages hundreds of tokens, so its rounding is far below bf16's
epsilon of 2^-8: on a CPU, both bf16 curves of a tiny model strayed about 5e-4.)

The data is real text, shaped as SFT data: this repository's docs, each paragraph a completion
(its tokens' loss counted) under its section heading as the prompt (not counted), tokenized by
the checkpoint's tokenizer. The loss of a step is the mean over its counted tokens of their
negative log-likelihood, read from the logprobs each path returns for the step's forward.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tinsmith.devtools.peft_twin import peft_twin
from tinsmith.models.loading import load_model
from tinsmith.types import AdamParams, Datum, ForwardBackwardInput, LoraSpec
from tinsmith.worker.runtime import TrainRequest
from tinsmith.worker.service import RuntimeOptions, training_runtime

RANK = 32
DOCS = Path(__file__).resolve().parents[2] / "docs"
NOISE_FLOOR = 1e-4
# A bf16 curve is within bf16 noise when it strays at most this many times as far as the plain bf16 run.
NOISE_FACTOR = 2.0


def doc_examples(docs: Path = DOCS) -> list[tuple[str, str]]:
    """(prompt, completion) pairs: each paragraph of ``docs``' markdown files (prose, lists and
    tables alike; code fences dropped) under its nearest heading, in file order."""
    out = []
    for path in sorted(docs.glob("*.md")):
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        heading = path.stem
        for block in re.split(r"\n\s*\n", text):
            block = block.strip()
            if not block:
                continue
            if block.startswith("#"):
                first, _, rest = block.partition("\n")
                heading, block = first.lstrip("#").strip(), rest.strip()
                if not block:
                    continue
            out.append((heading, block))
    return out


def sft_data(tokenizer, count: int, max_len: int, skip: int = 0, min_completion: int = 8) -> list[Datum]:
    """``count`` SFT datums of at most ``max_len`` tokens from :func:`doc_examples`, starting at
    the ``skip``-th usable one (wrapping around): the prompt's tokens weigh 0, the completion's 1."""
    usable = []
    for prompt, completion in doc_examples():
        p = tokenizer.encode(prompt + "\n", add_special_tokens=False)
        c = tokenizer.encode(completion, add_special_tokens=False)
        ids = (p + c)[:max_len + 1]
        if len(ids) - len(p) < min_completion:
            continue
        usable.append((np.asarray(ids, np.int64), len(p)))
    if not usable:
        raise RuntimeError(f"no SFT examples in {DOCS}")
    out = []
    for i in range(skip, skip + count):
        ids, prompt_len = usable[i % len(usable)]
        weights = (np.arange(1, len(ids)) >= prompt_len).astype(np.float32)  # the targets' positions
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:], "weights": weights}))
    return out


def mean_nll(logprobs: list[np.ndarray], data: list[Datum]) -> float:
    """The mean negative log-likelihood of the counted targets of ``data``."""
    w = [np.asarray(d.loss_inputs["weights"], np.float64) for d in data]
    return float(-sum((np.asarray(lp, np.float64) * x).sum() for lp, x in zip(logprobs, w)) / sum(x.sum() for x in w))


def tinsmith_run(model_dir, device: torch.device, dtype: torch.dtype | None, steps: list[dict[int, list[Datum]]],
                 hp: AdamParams) -> tuple[dict[int, list[float]], dict[int, dict[str, torch.Tensor]]]:
    """Train one adapter per seed of ``steps[0]`` (each step: seed -> its datums), every adapter's
    datums in one forward/backward and their optimizer steps together, on a runtime built as the
    server builds it. Returns each seed's loss curve and its adapter's initial weights (fp32)."""
    lm = load_model(str(model_dir), device=device, dtype=dtype)
    rt = training_runtime(lm, RuntimeOptions(max_lora_adapters=max(4, len(steps[0])), max_lora_rank=RANK))
    units = {seed: rt.create_adapter(LoraSpec(rank=RANK, seed=seed)) for seed in steps[0]}
    initial = {seed: {n: p.detach().float().cpu().clone() for n, p in rt.unit(u).named_stepped}
               for seed, u in units.items()}
    curves: dict[int, list[float]] = {seed: [] for seed in units}
    try:
        for work in steps:
            reqs = [TrainRequest(units[seed], ForwardBackwardInput(data, "cross_entropy")) for seed, data in work.items()]
            for seed, res in zip(work, rt.forward_backward(reqs)):
                if isinstance(res, Exception):
                    raise res
                curves[seed].append(mean_nll([o["logprobs"] for o in res.outputs], work[seed]))
            for res in rt.optim_steps([(units[seed], hp) for seed in work]):
                if isinstance(res, Exception):
                    raise res
    finally:
        del rt, lm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return curves, initial


def peft_run(model_dir, device: torch.device, dtype: torch.dtype, weights: dict[str, torch.Tensor],
             steps: list[list[Datum]], hp: AdamParams) -> list[float]:
    """The plain path's curve: transformers + peft from ``weights``, each datum's summed loss
    backward in turn (the runtime's cross-entropy is a sum over datums), then torch's AdamW."""
    twin = peft_twin(model_dir, LoraSpec(rank=RANK), weights, dtype=dtype, device=device)
    opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=hp.learning_rate,
                            betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
    curve = []
    try:
        for data in steps:
            logprobs = []
            for d in data:
                ids = torch.as_tensor(d.tokens, device=device)[None]
                targets = torch.as_tensor(d.loss_inputs["target_tokens"], device=device)
                logits = twin(input_ids=ids).logits[0].float()
                lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
                (-(lp * torch.as_tensor(d.loss_inputs["weights"], device=device)).sum()).backward()
                logprobs.append(lp.detach().cpu().numpy())
            curve.append(mean_nll(logprobs, data))
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        del twin, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return curve


def max_rel_dev(curve: list[float], reference: list[float]) -> float:
    """The largest ``|loss - reference| / reference`` over the steps."""
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def sft_curves(model_dir, device: torch.device, quick: bool, steps: int | None = None, rows: int | None = None,
               max_len: int | None = None, tenants: int | None = None, learning_rate: float = 1e-3,
               dtype: torch.dtype | None = None) -> dict:
    """Every run's loss curve (see the module docstring) and how far each strays from the fp32
    reference. ``dtype``: the runtime's and the plain bf16 run's (default: the one the server
    loads in on ``device``, bf16 on a GPU, fp32 on a CPU, where the fp32 runs are then the same)."""
    import transformers

    steps = steps or (3 if quick else 16)
    rows = rows or (2 if quick else 8)
    max_len = max_len or (32 if quick else 512)
    tenants = tenants or (2 if quick else 4)
    hp = AdamParams(learning_rate=learning_rate)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    # tenant t's step s: its own rows of the docs; tenant 0's are the single-tenant run's
    data = {t: [sft_data(tok, rows, max_len, skip=(t * steps + s) * rows) for s in range(steps)] for t in range(tenants)}
    low = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)  # the dtype the server loads in
    curves: dict[str, list[float]] = {}
    alone, initial = tinsmith_run(model_dir, device, low, [{0: data[0][s]} for s in range(steps)], hp)
    curves["tinsmith"] = alone[0]
    together, initial_t = tinsmith_run(model_dir, device, low,
                                       [{t: data[t][s] for t in range(tenants)} for s in range(steps)], hp)
    curves["tinsmith_tenants"] = together[0]
    same_start = all(torch.equal(initial[0][n], initial_t[0][n]) for n in initial[0])
    curves["tinsmith_fp32"] = tinsmith_run(model_dir, device, torch.float32, [{0: d} for d in data[0]], hp)[0][0]
    curves["peft_fp32"] = peft_run(model_dir, device, torch.float32, initial[0], data[0], hp)
    curves["peft"] = peft_run(model_dir, device, low, initial[0], data[0], hp) if low != torch.float32 else curves["peft_fp32"]
    ref = curves["peft_fp32"]
    dev = {k: max_rel_dev(c, ref) for k, c in curves.items() if k != "peft_fp32"}
    noise = max(dev["peft"], NOISE_FLOOR)
    return {
        "dtype": str(low).removeprefix("torch."), "steps": steps, "rows": rows, "max_len": max_len, "tenants": tenants,
        "learning_rate": learning_rate,
        "counted_tokens_per_step": [int(sum(d.loss_inputs["weights"].sum() for d in s)) for s in data[0]],
        "same_initial_weights": same_start, "curves": curves, "max_rel_dev": dev,
        "tenants_vs_alone": max_rel_dev(curves["tinsmith_tenants"], curves["tinsmith"]),
        "bf16_noise": noise, "noise_ratio": dev["tinsmith"] / noise,
        "tenants_noise_ratio": dev["tinsmith_tenants"] / noise,
        "worst_noise_ratio": max(dev["tinsmith"], dev["tinsmith_tenants"]) / noise,
        "within_bf16_noise": max(dev["tinsmith"], dev["tinsmith_tenants"]) <= NOISE_FACTOR * noise,
    }
