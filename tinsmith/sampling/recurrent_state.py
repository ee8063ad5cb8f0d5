"""Per-row recurrent state of hybrid models' Gated DeltaNet layers, kept beside the KV cache.

Each linear layer holds, per sampler row, the last ``kernel - 1`` inputs of its causal
convolution (rows x conv_dim x (kernel - 1), the model's dtype) and its delta-rule state
(rows x value_heads x key_dim x value_dim, fp32 as transformers keeps it). Unlike K/V, the size
does not grow with the sequence. Rows stay dense exactly as the KV cache's: a prefill writes a
row, a finished row is overwritten by the last one.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tinsmith.models.config import ModelConfig


class RowRecurrentState:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, rows: int):
        la = cfg.linear_attn
        assert la is not None
        self.layers = [i for i in range(cfg.num_layers) if cfg.is_linear_layer(i)]
        self.kernel = la.conv_kernel
        self.conv_shape = (la.conv_dim, la.conv_kernel - 1)
        self.state_shape = (la.num_value_heads, la.key_head_dim, la.value_head_dim)
        self.device, self.dtype = device, dtype
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        self.rows = 0
        self.resize(rows)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.conv.values()) + list(self.state.values()))

    def resize(self, rows: int) -> None:
        """Grow or shrink to ``rows`` rows, keeping the first ones."""
        keep = min(rows, self.rows)
        for i in self.layers:
            conv = torch.zeros((rows, *self.conv_shape), device=self.device, dtype=self.dtype)
            state = torch.zeros((rows, *self.state_shape), device=self.device, dtype=torch.float32)
            if keep:
                conv[:keep], state[:keep] = self.conv[i][:keep], self.state[i][:keep]
            self.conv[i], self.state[i] = conv, state
        self.rows = rows

    def write_row(self, row: int, prefill: PrefillStates, i: int) -> None:
        """Row ``row`` takes prompt ``i`` of a recorded prefill."""
        for layer in self.layers:
            self.conv[layer][row] = prefill.conv[layer][i]
            self.state[layer][row] = prefill.state[layer][i]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows ``src`` move to rows ``dst`` (device indices; every source read before any write)."""
        for layer in self.layers:
            self.conv[layer][dst] = self.conv[layer][src]
            self.state[layer][dst] = self.state[layer][src]


class PrefillStates:
    """What a prefill of right-padded prompts leaves per Gated DeltaNet layer (see
    :class:`tinsmith.models.gated_deltanet.RecurrentStates`)."""

    decoding = False

    def __init__(self, lengths: torch.Tensor, width: int, kernel: int, after: PrefillStates | None = None):
        """``after``: the states of the prefill this one continues (a long prompt's earlier chunks)."""
        self.lengths, self.kernel = lengths, kernel
        self.valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
        self.after = after
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}

    def initial(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.after is None else (self.after.conv[layer_idx], self.after.state[layer_idx])

    def record(self, layer_idx: int, conv_inputs: torch.Tensor, state: torch.Tensor) -> None:
        """Keep each prompt's last ``kernel - 1`` convolution inputs (before its start: zeros, or
        those of the prefill it continues) and state."""
        x = conv_inputs.transpose(1, 2)
        if self.after is None:
            x = F.pad(x, (self.kernel - 1, 0))  # (b, C, kernel - 1 + L)
        else:
            x = torch.cat((self.after.conv[layer_idx], x.to(self.after.conv[layer_idx].dtype)), dim=-1)
        index = self.lengths[:, None] + torch.arange(self.kernel - 1, device=x.device)[None, :]
        self.conv[layer_idx] = x.gather(2, index[:, None, :].expand(-1, x.shape[1], -1))
        self.state[layer_idx] = state

    @classmethod
    def stacked(cls, parts: list[PrefillStates | None]) -> PrefillStates:
        """The states of one prompt each (``parts[i]``, as :meth:`select` gives them; None: a prompt
        that starts from nothing, zeros) as those a prefill of all of them continues from."""
        ref = next(p for p in parts if p is not None)
        out = cls(torch.zeros(len(parts), dtype=torch.long, device=ref.lengths.device), 0, ref.kernel)
        for name in ("conv", "state"):
            mine, theirs = getattr(out, name), getattr(ref, name)
            for layer, t in theirs.items():
                zero = torch.zeros_like(t[0])
                mine[layer] = torch.stack([zero if p is None else getattr(p, name)[layer][0] for p in parts])
        return out

    def select(self, i: int) -> PrefillStates:
        """Prompt ``i``'s states alone (copies), as prompt 0 of a prefill of one."""
        # The prefill's width, not the prompt's own length: reading that would wait for the device,
        # and the mask it sizes is the same over the prompt's positions.
        out = PrefillStates(self.lengths[i : i + 1], self.valid.shape[1], self.kernel)
        out.conv = {layer: t[i : i + 1].clone() for layer, t in self.conv.items()}
        out.state = {layer: t[i : i + 1].clone() for layer, t in self.state.items()}
        return out

    def get(self, layer_idx: int):
        raise RuntimeError("a prefill has no states to read")

    def put(self, layer_idx: int, conv_state: torch.Tensor, state: torch.Tensor) -> None:
        raise RuntimeError("a prefill records its states")


class DecodeStates:
    """The recurrent states of rows ``[0, n)`` for one decode step.

    ``live`` (n,) 0/1 marks the padding rows of a fixed-shape step (0), as for the K/V cache:
    their states must come out of the step as they went in. The delta rule leaves a state
    exactly as it is under no decay and no write (the model gates a padding row's decay and
    write strength to 0, see :meth:`gate`); the convolution's inputs are put back as they were.
    """

    decoding = True
    valid = None

    def initial(self, layer_idx: int) -> None:
        return None

    def __init__(self, store: RowRecurrentState, n: int, live: torch.Tensor | None = None):
        self.store, self.n, self.live = store, n, live

    def gate(self, g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's log-decay ``g`` and write strength ``beta`` (n, 1, heads), zero for padding rows."""
        if self.live is None:
            return g, beta
        keep = self.live[:, None, None]
        return g * keep.to(g.dtype), beta * keep.to(beta.dtype)

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.conv[layer_idx][: self.n], self.store.state[layer_idx][: self.n]

    def put(self, layer_idx: int, conv_state: torch.Tensor, state: torch.Tensor) -> None:
        conv = self.store.conv[layer_idx][: self.n]
        if self.live is not None:
            conv_state = torch.where(self.live.bool()[:, None, None], conv_state, conv)
        conv.copy_(conv_state)
        rows = self.store.state[layer_idx][: self.n]
        if state.data_ptr() != rows.data_ptr():  # not already advanced in place (the fused kernel)
            rows.copy_(state)

    def record(self, layer_idx: int, conv_inputs: torch.Tensor, state: torch.Tensor) -> None:
        raise RuntimeError("a decode step updates states in place")
