"""How the engine shares the device between training and sampling: by time, per API key.

Training runs in turns (a few single jobs, then one chunk of forward/backward that all training
keys share) and sampling in slices (about ``sampling_slice_s`` of decode steps that all sampling
keys' rows share). The two take very different times: on a CPU a training chunk of one micro-batch
takes a second where a slice takes 50 ms, and on a GPU a chunk is often three times a slice. Taking
them in strict alternation handed the device to whichever kind's turns were longer: a key
sampling beside a key training kept a third of its speed alone while the trainer kept 94%.

So each kind keeps a virtual clock that advances by the time its turns take divided by how many
keys have work of that kind; whichever kind is behind goes next. Two keys, one training and one
sampling, get the device half each; three training keys beside one sampling key get three
quarters for training, and so on: every key about the same share of time, as the training chunks
already share tokens among training keys. A kind that had no work gets no credit for the time
it was idle (its clock follows the other's, turn by turn), so a newcomer goes first once and then
takes its share, rather than holding the device until it has caught up.
"""

from __future__ import annotations

KINDS = ("train", "sample")
# A turn is charged at least this: a kind whose turns take no time (nothing could run) still
# hands the device over after a bounded number of them.
MIN_TURN_S = 0.001


class DeviceShares:
    """Virtual clocks of the two kinds of work; :meth:`next` picks the turn, :meth:`charge` pays for it."""

    def __init__(self) -> None:
        self.clock = {kind: 0.0 for kind in KINDS}  # seconds of device time per key with work
        self.spent = {kind: 0.0 for kind in KINDS}  # seconds in all (for metrics and tests)
        self.last: str | None = None
        self.idle: set[str] = set()  # kinds without work when the turn being run was chosen

    def next(self, training: bool, sampling: bool) -> str | None:
        """The kind whose turn it is (None when neither has work)."""
        busy = [kind for kind, has in zip(KINDS, (training, sampling)) if has]
        self.idle = {kind for kind in KINDS if kind not in busy}
        if len(busy) != 2:
            return busy[0] if busy else None
        train, sample = self.clock["train"], self.clock["sample"]
        if train == sample:  # a tie: the kind that did not just run
            return "sample" if self.last == "train" else "train"
        return "train" if train < sample else "sample"

    def charge(self, kind: str, seconds: float, keys: int) -> None:
        """``kind``'s turn took ``seconds`` while ``keys`` API keys had work of that kind."""
        seconds = max(MIN_TURN_S, seconds)
        self.clock[kind] += seconds / max(1, keys)
        self.spent[kind] += seconds
        self.last = kind
        for idle in self.idle:  # no credit for a turn it had no work for: it starts level, and goes next
            self.clock[idle] = max(self.clock[idle], self.clock[kind])
