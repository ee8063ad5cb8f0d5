"""Teach a tiny random model the answer format of the compat suite's toy tasks (runs in the cookbook venv).

A random model never writes ``\\boxed{...}`` nor the role_colon stop ``\\n\\nUser:``, so every RL group
would get one constant reward, zero advantages and zero gradients (``rl_loop`` then skips
``forward_backward`` altogether). Eighty full-weight AdamW steps on prompts rendered by the
cookbook's own ``role_colon`` renderer fix that: after ``Assistant:`` the model answers
``\\boxed{0}`` or ``\\boxed{1}`` at random and stops about half of the time, and rambles past any
small ``max_tokens`` otherwise. Rewards then differ inside a group, so the RL losses get real
advantages. The result is written over ``MODEL_DIR``'s weights (tokenizer and config unchanged).

usage: python warm_start.py MODEL_DIR [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random

import torch
import transformers
from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import get_tokenizer
from clean_exit import finish  # noqa: E402 - the script's own folder is on sys.path

WORDS = ("the a and to of in on with from up down small large fast slow red blue green one two three "
         "hello world answer number sum plus what is why how when").split()

GSM8K_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
STRAWBERRY = [
    {"role": "user", "content": "How many r's are in strawberry?" + GSM8K_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
     "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]


def questions(rng: random.Random) -> list[list[dict]]:
    """Prompt shapes the suite's RL recipes use (rl_loop's GSM8K few-shot, arithmetic, free chat)."""
    a, b = rng.randint(0, 100), rng.randint(0, 100)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
    return [
        [*STRAWBERRY, {"role": "user", "content": f"What is {a % 2} plus {b % 2} minus {b % 2}?" + GSM8K_SUFFIX}],
        [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"},
         {"role": "user", "content": f"What is {a} + {b}?"}],
        [{"role": "user", "content": words.capitalize() + "?"}],
    ]


def answer(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"\\boxed{{{rng.randint(0, 1)}}}"
    return " ".join(rng.choice(WORDS) for _ in range(40))  # never stops within a small max_tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tok = get_tokenizer(a.model_dir)
    renderer = renderers.get_renderer("role_colon", tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    losses = []
    for step in range(a.steps):
        seqs = []
        for _ in range(a.batch):
            convo = rng.choice(questions(rng)) + [{"role": "assistant", "content": answer(rng)}]
            mi, w = renderer.build_supervised_example(convo)
            seqs.append((mi.to_ints(), w.tolist()))
        n = max(len(t) for t, _ in seqs)
        ids = torch.full((len(seqs), n), tok.eos_token_id, dtype=torch.long)
        wts = torch.zeros((len(seqs), n))
        for i, (t, w) in enumerate(seqs):
            ids[i, : len(t)] = torch.tensor(t)
            wts[i, : len(w)] = torch.tensor(w, dtype=torch.float32)
        logits = model(input_ids=ids[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * wts[:, 1:]).sum() / wts[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.save_pretrained(a.model_dir, safe_serialization=True)
    print(json.dumps({"first_loss": losses[0], "last_loss": sum(losses[-10:]) / 10, "steps": a.steps}))


if __name__ == "__main__":
    main()
    finish()
