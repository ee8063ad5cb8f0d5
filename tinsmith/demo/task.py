"""The demo's synthetic task: multi-digit addition, written as characters.

A prompt is ``"347+85="``; the answer is ``"432"`` followed by the end token. Every digit and
operator is one token, so the model sees the same symbols a person would. The tokenizer is a
real ``tokenizers`` BPE model with no merges (each character is its own token), saved as
``tokenizer.json`` next to the weights so the model directory is an ordinary HF checkpoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIALS = [EOS, PAD]
CHARS = list("0123456789+=")
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
EOS_ID = VOCAB[EOS]
PAD_ID = VOCAB[PAD]
MODEL_VOCAB_SIZE = 16  # embedding rows: the 14 tokens above, rounded up

MAX_DIGITS = 3  # operands have 1..MAX_DIGITS digits
MAX_ANSWER_TOKENS = MAX_DIGITS + 2  # the longest sum plus the end token, plus one spare


def build_tokenizer():
    """A character-level ``tokenizers.Tokenizer``: digits, ``+`` and ``=`` are single tokens."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab=dict(VOCAB), merges=[], unk_token=None))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    return tok


_ID_TO_CHAR = {i: t for t, i in VOCAB.items()}


def encode(text: str) -> list[int]:
    """Characters of ``text`` to token ids (same ids as the saved tokenizer)."""
    try:
        return [VOCAB[c] for c in text]
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the demo's vocabulary") from None


def decode(ids: list[int]) -> str:
    """Token ids to text; the end token (and anything after it) is dropped."""
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        out.append(_ID_TO_CHAR.get(int(i), "?"))
    return "".join(out)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def prompt_ids(self) -> list[int]:
        return encode(self.prompt)

    def answer_ids(self) -> list[int]:
        """The answer's tokens, ending with the end token."""
        return encode(self.answer) + [EOS_ID]


def random_problem(rng: random.Random, max_digits: int = MAX_DIGITS) -> Problem:
    """Operands with a uniformly drawn number of digits (1..max_digits) each."""
    def operand() -> int:
        n = rng.randint(1, max_digits)
        return rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1)

    return Problem(operand(), operand())


def problems(n: int, seed: int, max_digits: int = MAX_DIGITS) -> list[Problem]:
    rng = random.Random(seed)
    return [random_problem(rng, max_digits) for _ in range(n)]


def reward(problem: Problem, completion: list[int]) -> float:
    """1.0 for the exact answer followed by the end token; otherwise partial credit in [0, 0.5).

    Partial credit is half the fraction of answer digits that are right, compared from the
    right (units under units) and divided by the longer of the two lengths, so a wrong
    length costs. A completion that never ends (no end token) gets 0.
    """
    if EOS_ID not in completion:
        return 0.0
    text = decode(completion)
    target = problem.answer
    if text == target:
        return 1.0
    if not text or not text.isdigit():
        return 0.0
    hits = sum(x == y for x, y in zip(reversed(text), reversed(target)))
    return 0.5 * hits / max(len(text), len(target))


def is_correct(problem: Problem, completion: list[int]) -> bool:
    return EOS_ID in completion and decode(completion) == problem.answer
