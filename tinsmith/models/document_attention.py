"""Document-causal attention: one packed row holding many sequences, each attending to itself only.

A packed training micro-batch concatenates its sequences into a single row of ``T`` tokens (no
padding); ``bounds`` (the documents' cumulative lengths, ``cu_seqlens``) say where each starts.
A query sees the keys of its own document at or before its position (and, on a sliding-window
layer, within the window), so every document gets exactly what it would get alone.

Two implementations:

* CUDA (compute capability 8.0 and newer, as Flash Attention needs), half precision, no
  attention sinks: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention over the cumulative
  lengths; its sliding window and grouped-query heads used when the
  installed torch offers them, checked from its signature once).
* Everywhere else (the CPU, float32, gpt-oss's sinks): :func:`causal_attention` per document, over
  slices of the row. Measured on a 2-core CPU (16 documents of 64..512 tokens, 8 query / 2 K/V
  heads, forward and backward) it ran 1.0-1.7 s against 1.8-2.3 s for one SDPA call with a
  block-diagonal (T x T) mask, whose cost and memory also grow with the square of the whole row
  rather than of each document.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from tinsmith.models.layers import causal_attention
from tinsmith.transfers import to_device

_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _varlen() -> tuple[Callable, bool, bool] | None:
    """torch's variable-length attention, and whether it takes ``window_size`` and ``enable_gqa``
    (None: this torch has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
    except (ImportError, TypeError, ValueError):  # no such module, or a signature we cannot read
        return None
    return varlen_attn, "window_size" in params, "enable_gqa" in params


@functools.cache
def _flash_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


class DocumentAttention:
    """An :class:`~tinsmith.models.layers.AttentionBackend` over one packed row (batch size 1).

    ``bounds`` are the document boundaries on the row: ``[0, len_0, len_0 + len_1, ..., T]``.
    """

    def __init__(self, bounds: list[int]):
        if len(bounds) < 2 or bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"document bounds must rise from 0, got {bounds[:8]}")
        self.bounds = bounds
        self.lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        self.max_len = max(self.lengths)
        self._cu_seqlens: torch.Tensor | None = None  # on the device, made at the first varlen call
        self._real: torch.Tensor | None = None  # flat indices of the real positions of :meth:`pad`'s layout

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """The row ``x`` (1, T, ...) as right-padded documents (n, max_len, ...), zeros after each.

        For layers that carry state along the sequence (Gated DeltaNet's convolution and delta
        rule): run on this layout, each document starts from a zero state, exactly as alone.
        """
        return pad_sequence(list(x[0].split(self.lengths)), batch_first=True)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`pad`: the documents' real positions back on one row (1, T, ...)."""
        if self._real is None:
            real = np.arange(self.max_len)[None, :] < np.array(self.lengths)[:, None]
            self._real = torch.from_numpy(np.flatnonzero(real)).to(y.device)
        return y.reshape(-1, *y.shape[2:]).index_select(0, self._real)[None]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        if q.shape[0] != 1 or q.shape[2] != self.bounds[-1]:
            raise ValueError(f"packed attention expects one row of {self.bounds[-1]} tokens, got {tuple(q.shape)}")
        if len(self.bounds) == 2:
            return causal_attention(layer_idx, q, k, v, sinks=sinks, window=window)
        if self._varlen_applies(q, sinks, window):
            return self._varlen_attention(q, k, v, window)
        docs = zip(self.bounds, self.bounds[1:])
        return torch.cat([causal_attention(layer_idx, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], sinks=sinks,
                                           window=window) for a, b in docs], dim=2)

    def _varlen_applies(self, q: torch.Tensor, sinks: torch.Tensor | None, window: int | None) -> bool:
        found = _varlen()
        if found is None or not q.is_cuda or q.dtype not in _HALF or sinks is not None:
            return False
        d = q.shape[-1]
        takes_window = found[1]
        return (d % 8 == 0 and d <= 256 and (window is None or takes_window)
                and _flash_capable(q.device.index if q.device.index is not None else torch.cuda.current_device()))

    def _varlen_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        varlen_attn, takes_window, takes_gqa = _varlen()  # type: ignore[misc]
        if self._cu_seqlens is None:
            self._cu_seqlens = to_device(self.bounds, q.device, torch.int32)
        # (1, H, T, d) -> (T, H, d): the projections' own layout, so these are views.
        qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))
        qt, kt, vt = (x if x.stride(-1) == 1 else x.contiguous() for x in (qt, kt, vt))
        kwargs: dict = {}
        if kt.shape[1] != qt.shape[1]:
            if takes_gqa:
                kwargs["enable_gqa"] = True
            else:
                rep = qt.shape[1] // kt.shape[1]
                kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
        if takes_window:  # (left, right): a window of w keys, the query's own included, is (w - 1, 0)
            kwargs["window_size"] = (-1 if window is None else window - 1, 0)
        else:
            kwargs["is_causal"] = True
        cu = self._cu_seqlens
        out = varlen_attn(qt, kt, vt, cu, cu, self.max_len, self.max_len, **kwargs)
        return out.transpose(0, 1)[None]
