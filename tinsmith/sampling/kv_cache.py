"""KV cache for continuous batching: one row per live sequence, grown in blocks.

Each layer keeps ``K, V`` of shape ``(rows, kv_heads, capacity, head_dim)``. Capacity grows in
blocks of ``BLOCK`` positions as the longest live sequence grows (never reserved for the
maximum length up front), and rows are kept dense: when a sequence finishes, the last live row
moves into its place, so a decode step always runs over rows ``[0, n)``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tinsmith.models.config import ModelConfig
from tinsmith.models.layers import masked_attention

BLOCK = 64


def _round_up(n: int, block: int) -> int:
    return max(block, -(-n // block) * block)


class RowKVCache:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, rows: int = 8,
                 max_bytes: int = 0):
        self.cfg = cfg
        self.max_bytes = max_bytes  # growth in rows stays within it where it can (0: no bound)
        self.device, self.dtype = device, dtype
        self.capacity = BLOCK
        rows = self._rows_within(rows, BLOCK)
        self.row_capacity = rows
        shape = (rows, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        self.K = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.V = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # tokens held per row

    def _rows_within(self, rows: int, capacity: int) -> int:
        """``rows``, or fewer (at least 1) where ``max_bytes`` holds fewer rows of ``capacity`` positions:
        spare rows are never allocated beyond the budget."""
        if not self.max_bytes:
            return rows
        width = torch.finfo(self.dtype).bits // 8
        per_row = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * capacity * self.cfg.head_dim * width
        return max(1, min(rows, self.max_bytes // per_row))

    def nbytes(self) -> int:
        """Bytes the cache's buffers take (for metrics; its lists may be swapped meanwhile, a copy is read)."""
        return sum(t.numel() * t.element_size() for t in list(self.K) + list(self.V))

    # ----------------------------------------------------------------------------- sizing
    def ensure(self, rows: int, length: int) -> None:
        """Make room for ``rows`` rows of ``length`` positions (grows geometrically / by blocks)."""
        if rows <= self.row_capacity and length <= self.capacity:
            return
        new_cap = self.capacity if length <= self.capacity else _round_up(max(length, self.capacity + BLOCK), BLOCK)
        new_rows = self.row_capacity if rows <= self.row_capacity else max(rows, 2 * self.row_capacity)
        new_rows = max(rows, self._rows_within(new_rows, new_cap))  # spare rows only within the budget
        keep = min(new_rows, self.row_capacity)  # rows are dense: those past ``rows`` hold nothing
        shape = (new_rows, self.cfg.num_kv_heads, new_cap, self.cfg.head_dim)
        for store in (self.K, self.V):
            for i, old in enumerate(store):
                new = torch.zeros(shape, device=self.device, dtype=self.dtype)
                new[:keep, :, : self.capacity] = old[:keep]
                store[i] = new
        lengths = torch.zeros(new_rows, dtype=torch.long, device=self.device)
        lengths[:keep] = self.lengths[:keep]
        self.lengths = lengths
        self.row_capacity, self.capacity = new_rows, new_cap

    def shrink(self, live_rows: int, max_len: int) -> None:
        """Give memory back when the batch has become much smaller than the buffers."""
        if self.capacity > 4 * _round_up(max_len, BLOCK) or self.row_capacity > 4 * max(live_rows, 8):
            cap = _round_up(max(max_len, 1), BLOCK)
            rows = max(live_rows, 1, self._rows_within(max(8, 2 * live_rows), cap))
            for store in (self.K, self.V):
                for i, old in enumerate(store):
                    store[i] = old[:rows, :, :cap].clone()
            self.lengths = self.lengths[:rows].clone()
            self.row_capacity, self.capacity = rows, cap

    # ----------------------------------------------------------------------------- rows
    def write_prefix(self, row: int, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Copy a prefilled prompt's K/V ``(kv_heads, length, head_dim)`` per layer into ``row``."""
        for i, (k, v) in enumerate(layer_kv):
            self.K[i][row, :, :length] = k[:, :length]
            self.V[i][row, :, :length] = v[:, :length]
        self.lengths[row] = length

    def move_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        n = int(self.lengths[src])
        for store in (self.K, self.V):
            for t in store:
                t[dst, :, :n] = t[src, :, :n]
        self.lengths[dst] = n

    # ----------------------------------------------------------------------------- attention
    def decode_attention(self, n: int, span: int):
        """Attention backend for one decode step over rows ``[0, n)``.

        Writes each row's new K/V at its current length, then attends over the row's
        ``length + 1`` positions; ``span`` is the longest of those (the caller has it already,
        from sizing the cache for this step). Grouped-query heads are folded into the query dimension, so
        cached K/V are never repeated.
        """
        pos = self.lengths[:n]
        rows = torch.arange(n, device=self.device)
        future = torch.arange(span, device=self.device)[None, :] > pos[:, None]  # (n, span)
        # An additive mask (0 / -inf), built once per step for all layers: SDPA takes it
        # faster than a boolean one.
        mask = torch.zeros(future.shape, dtype=self.dtype, device=self.device).masked_fill_(future, float("-inf"))
        mask = mask[:, None, None, :]
        visible: dict[int | None, torch.Tensor] = {}  # window -> (n, 1, span) keys each row sees

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
            K, V = self.K[layer], self.V[layer]
            K[rows, :, pos] = k[:, :, 0]
            V[rows, :, pos] = v[:, :, 0]
            if sinks is not None or window is not None:
                # Sliding layers keep every position in the cache and mask the ones out of the window.
                if window not in visible:
                    keys = torch.arange(span, device=self.device)[None, :]
                    seen = ~future if window is None else ~future & (keys > pos[:, None] - window)
                    visible[window] = seen[:, None]
                return masked_attention(q, K[:n, :, :span], V[:n, :, :span], visible[window], sinks)
            hq, hk = q.shape[1], k.shape[1]
            rep = hq // hk
            qg = q.reshape(n, hk, rep, q.shape[-1])  # (n, kv_heads, rep, d): rep queries per kv head
            out = F.scaled_dot_product_attention(qg, K[:n, :, :span], V[:n, :, :span], attn_mask=mask)
            return out.reshape(n, hq, 1, q.shape[-1])

        return attend


def recording_attention(store: list[tuple[torch.Tensor, torch.Tensor]]):
    """Causal attention for a prefill that also keeps every layer's K/V (after rotary)."""
    from tinsmith.models.layers import causal_attention

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        store.append((k, v))
        return causal_attention(layer, q, k, v, sinks=sinks, window=window)

    return attend
