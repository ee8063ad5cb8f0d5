"""Stop conditions: stop token ids (checked on the device for the whole batch) and stop strings.

Semantics (as the Tinker service): ``stop`` absent ends at EOS; ``stop=[]`` never ends early;
a list of token ids or strings ends at the first one *and* at EOS. The stop token, or the token
that completes a stop string (which may span several tokens), is included in the output.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopSpec:
    token_ids: tuple[int, ...]  # includes EOS unless stop == []
    strings: tuple[str, ...]


def stop_spec(stop: list[str] | list[int] | None, eos_ids: tuple[int, ...]) -> StopSpec:
    if stop is None:
        return StopSpec(tuple(eos_ids), ())
    if len(stop) == 0:
        return StopSpec((), ())
    if all(isinstance(s, int) for s in stop):
        return StopSpec(tuple(dict.fromkeys([*stop, *eos_ids])), ())  # type: ignore[list-item]
    return StopSpec(tuple(eos_ids), tuple(s for s in stop if s))  # type: ignore[misc]


class StringStopWatcher:
    """Watches one sequence's text for its stop strings, token by token.

    Only the tail of the text that a stop string could end in is decoded at each step, so the
    cost per token stays constant however long the sequence gets.
    """

    def __init__(self, strings: tuple[str, ...], decode):
        self.strings = strings
        self.decode = decode
        self.tokens: list[int] = []
        self.window = max(len(s) for s in strings) + 8  # tokens: each is at least one character

    def push(self, token: int) -> bool:
        """Add a generated token; True if the text now ends a stop string for the first time."""
        self.tokens.append(token)
        tail = self.tokens[-self.window :]
        before = self.decode(tail[:-1])
        after = self.decode(tail)
        # A stop string completed by this token: present now, and not entirely inside the text
        # that existed before this token.
        return any(s in after and after.rfind(s) + len(s) > len(before) for s in self.strings)
