"""Make the demo's starting model offline: a small Qwen3 pre-trained briefly on addition.

A random-initialised ``transformers`` Qwen3 (about 0.6M parameters, character vocabulary) is
trained with plain PyTorch on freshly drawn addition problems (loss on the answer tokens only)
until its greedy exact match on 1000 held-out problems reaches ``target_greedy`` (60%), which
takes a few hundred steps, well under two minutes on two CPU cores.

The pre-training data is deliberately noisy: in 30% of the examples one digit of the answer is
replaced by a wrong one. The model still learns the sum well enough for its most likely answer
to be right most of the time, but it keeps that noise as uncertainty, so answers *sampled* at
temperature 1 are right only about half as often as its greedy ones. That is the room the RL
phase has to improve: a reward that checks the answer teaches it to trust what it knows (and
to fix what it does not).

The result is an ordinary HF model directory (``config.json``, safetensors, ``tokenizer.json``)
that ``tinsmith serve`` loads like any other. A ``demo_model.json`` beside the weights records
the settings and the measured accuracy; a later call with the same settings finds it there and
returns at once.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tinsmith.demo import task
from tinsmith.progress import bar, progress_wanted

RECIPE_VERSION = 1


@dataclass(frozen=True)
class PretrainConfig:
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    max_steps: int = 1500
    target_greedy: float = 0.6  # stop once held-out greedy exact match reaches this
    eval_every: int = 25
    label_noise: float = 0.3  # fraction of training answers with one digit replaced by a wrong one
    batch_size: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    seed: int = 1
    eval_problems: int = 1000

    def key(self) -> dict:
        return {"recipe_version": RECIPE_VERSION, **asdict(self)}


def hf_config(cfg: PretrainConfig):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=task.MODEL_VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=3 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        bos_token_id=task.EOS_ID,
        eos_token_id=task.EOS_ID,
        pad_token_id=task.PAD_ID,
    )


def noisy_answer(p: task.Problem, rng: random.Random) -> list[int]:
    """The answer with one digit replaced by a different random digit, then the end token."""
    digits = list(p.answer)
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return task.encode("".join(digits)) + [task.EOS_ID]


def sft_batch(problems: list[task.Problem], answers: list[list[int]] | None = None):
    """Right-padded token ids and labels (-100 everywhere but the answer and its end token)."""
    import torch

    answers = answers or [p.answer_ids() for p in problems]
    seqs = [p.prompt_ids() + a for p, a in zip(problems, answers)]
    T = max(map(len, seqs))
    x = torch.full((len(seqs), T), task.PAD_ID, dtype=torch.long)
    y = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (p, s) in enumerate(zip(problems, seqs)):
        P = len(p.prompt)
        x[i, : len(s)] = torch.tensor(s)
        y[i, P - 1 : len(s) - 1] = torch.tensor(s[P:])
    return x, y


def evaluate(model, problems: list[task.Problem]) -> dict[str, float]:
    """Exact-match rates on ``problems``, computed in one teacher-forced pass.

    ``greedy``: the greedy decode is exactly right iff the argmax is the target token at every
    answer position given the right prefix. ``sampled``: the probability that a temperature-1
    sample is exactly right, i.e. exp of the summed answer logprobs, averaged.
    """
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        x, y = sft_batch(problems)
        logits = model(input_ids=x).logits.float()
        mask = y != -100
        yy = y.clamp(min=0)
        lp = torch.log_softmax(logits, -1).gather(-1, yy[..., None])[..., 0] * mask
        right = (logits.argmax(-1) == yy) | ~mask
        out = {"greedy": float(right.all(1).float().mean()), "sampled": float(lp.sum(1).exp().mean())}
    model.train(was_training)
    return out


def pretrain(cfg: PretrainConfig = PretrainConfig(), log=print, threads: int = 1):
    """Train the starting model; returns ``(model, stats)``.

    ``threads`` is torch's intra-op thread count while training. One is the default: this
    model's matmuls are too small to gain much from a second thread, and on a busy machine
    two spinning threads can be several times slower than one.
    """
    import torch

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return _pretrain(cfg, log)
    finally:
        torch.set_num_threads(prev_threads)


def _pretrain(cfg: PretrainConfig, log):
    import torch
    import transformers

    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32)
    rng = random.Random(cfg.seed + 1)
    held_out = task.problems(cfg.eval_problems, seed=10_000 + cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    loss_v = float("nan")
    acc = {"greedy": 0.0, "sampled": 0.0}
    step = 0
    steps_bar = bar(progress_wanted(), total=cfg.max_steps, desc="pre-training", unit="step", leave=False)
    while step < cfg.max_steps and acc["greedy"] < cfg.target_greedy:
        for g in opt.param_groups:
            g["lr"] = cfg.learning_rate * min(1.0, (step + 1) / cfg.warmup_steps)
        batch = [task.random_problem(rng) for _ in range(cfg.batch_size)]
        answers = [noisy_answer(p, rng) if rng.random() < cfg.label_noise else p.answer_ids() for p in batch]
        x, y = sft_batch(batch, answers)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_v = float(loss.detach())
        step += 1
        steps_bar.update()
        if step % cfg.eval_every == 0:
            acc = evaluate(model, held_out)
            log(f"pretrain step {step:4d}  loss {loss_v:.3f}  held-out exact match {100 * acc['greedy']:4.1f}% greedy, "
                f"{100 * acc['sampled']:4.1f}% sampled  {time.perf_counter() - t0:5.1f}s")
    steps_bar.close()
    stats = {"steps": step, "final_loss": loss_v, "seconds": round(time.perf_counter() - t0, 1),
             "params": sum(p.numel() for p in model.parameters()),
             "held_out_exact_match": evaluate(model, held_out)}
    return model, stats


def save_model(model, out_dir: Path) -> None:
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=task.build_tokenizer(), eos_token=task.EOS,
                                                pad_token=task.PAD)
    fast.save_pretrained(out_dir)


def ensure_model(model_dir: str | Path, cfg: PretrainConfig = PretrainConfig(), log=print) -> tuple[Path, dict]:
    """Return the cached starting model in ``model_dir``, pre-training it first if needed."""
    model_dir = Path(model_dir)
    meta_path = model_dir / "demo_model.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("config") == cfg.key() and (model_dir / "model.safetensors").is_file():
            log(f"starting model: {model_dir} (cached; pre-trained in {meta['stats']['seconds']}s)")
            return model_dir, meta
    log(f"pre-training the starting model into {model_dir} (once; cached for later runs)")
    model, stats = pretrain(cfg, log)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    save_model(model, tmp)
    meta = {"config": cfg.key(), "stats": stats}
    (tmp / "demo_model.json").write_text(json.dumps(meta, indent=1))
    if model_dir.exists():
        import shutil

        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    return model_dir, meta


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Pre-train (or find cached) the demo's starting model.")
    p.add_argument("model_dir")
    p.add_argument("--target-greedy", type=float, default=PretrainConfig.target_greedy)
    p.add_argument("--label-noise", type=float, default=PretrainConfig.label_noise)
    p.add_argument("--seed", type=int, default=PretrainConfig.seed)
    a = p.parse_args(argv)
    _, meta = ensure_model(a.model_dir, PretrainConfig(target_greedy=a.target_greedy, label_noise=a.label_noise,
                                                       seed=a.seed))
    print(json.dumps(meta["stats"]))


if __name__ == "__main__":
    main()
