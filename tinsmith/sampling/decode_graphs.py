"""Decode steps over fixed-shape buffers, captured as CUDA graphs per batch-size bucket.

On a GPU a decode step is launch-bound: Python issues a few hundred small kernels per step and
the GPU waits for them. A CUDA graph records the step once and replays it with one launch, but
only if the step reads and writes the same device addresses with the same shapes every time and
never asks the host anything. So the static step here reads only persistent buffers:

- ``B`` rows, the smallest bucket (:data:`BUCKETS`) that holds the live rows; the rows past the
  live ones are inert padding (greedy, no adapter, at position 0, never advanced, and they
  leave the cache rows, pages and recurrent states they stand on untouched);
- K/V up to the cache's capacity (:meth:`RowKVCache.decode_attention` with ``span`` = capacity):
  through SDPA every position past a row's length masked, through the decode kernels only each
  row's own positions read (per-row buffers, or pages through the page table);
- a hybrid model's per-row Gated DeltaNet states;
- last tokens, random-stream keys and step counters, temperature / top-k / top-p, the adapter
  bank position per row (:class:`RowSlots` over a persistent index), all updated in place;
- the sampled tokens written into the last tokens' buffer (the next step's input), their logprobs
  into an output buffer.

The same step runs eagerly on CPU (tests check it samples exactly what the eager decode path
samples), and on CUDA it is captured after one real step on a side stream and replayed for the
rest. Graphs are kept per variant and span (the capacity), and all are recaptured when an
address they read changes: per-row buffers reallocated, a page pool grown or shrunk, an adapter
bank reallocated. What it cannot express stays on the eager path (the sampler
decides; see :meth:`DecodeGraphs.refusal`). A failed capture (a model that reads the device
from the host inside its step, such as routed experts run by the per-expert loop rather than
the grouped matmul: fp32, or a GPU older than Hopper) sends every later burst there too, logged
once: uncaptured, the padded static step only costs more than the eager one.
Under tensor parallelism every rank captures and replays the same steps, their collectives
(NCCL, which graphs can record) inside; the ranks agree on each capture (:class:`Peers`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tinsmith.models.layers import CausalLM
from tinsmith.models.lora import sync_banks
from tinsmith.kernels import lora_segments
from tinsmith.kernels.lora_segments import RowTiles
from tinsmith.models.lora_bank import RowSlots, adapters_epoch
from tinsmith.sampling.kv_cache import RowKVCache
from tinsmith.sampling.logits import KeyedUniforms, choose_tokens_masked

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

log = logging.getLogger(__name__)


def bucket_for(rows: int) -> int | None:
    """The smallest bucket holding ``rows`` rows (None: more rows than the largest bucket)."""
    return next((b for b in BUCKETS if b >= rows), None)


@dataclass(frozen=True)
class Variant:
    """What fixes a captured step's kernels beyond its buffers' addresses."""

    rows: int  # the bucket B
    lora: bool  # some row reads an adapter (the LoRA layers run their gathered ops)
    truncating: bool  # some row uses top-k / top-p (the step sorts every row)
    all_greedy: bool  # every row is greedy (the step only takes the argmax)
    top: int = 0  # the most top-k sample logprobs a row asks (the step keeps that many per row)
    tiles: int = 0  # the segmented LoRA kernels' tile count (their grid), 0 when rows take the gathered ones


class Peers(Protocol):
    """The other ranks of a tensor-parallel sampler, whose decode steps hold collectives.

    Every rank captures and replays the same graphs at the same steps (the lockstep sampler keeps
    their batches equal), so a captured step's collectives meet the other ranks'. Two things need
    the ranks to talk: a capture that failed on any rank must send every rank back to the eager
    step (a padded static step and an eager one do not exchange the same tensors), and a replay
    whose peer died must not leave the host waiting forever for its results."""

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` is true (each rank passes its own; all must call it)."""

    def fence(self) -> None:
        """Queue, after a burst's replays, one collective the process group watches: a replayed
        collective is invisible to its timeout, so without it a dead peer would hang the host's
        read-back of the burst instead of failing it."""


class StaticInputs:
    """The persistent per-row buffers of one bucket (``B`` rows)."""

    def __init__(self, rows: int, device: torch.device):
        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(rows, dtype=dtype, device=device)

        self.rows = rows
        self.last, self.keys, self.steps = zeros(torch.long), zeros(torch.long), zeros(torch.long)
        self.temperature, self.top_p = zeros(torch.float32), zeros(torch.float32)
        self.top_k, self.rope = zeros(torch.long), zeros(torch.long)
        self.active = zeros(torch.long)  # 1 for a live row: its cache length advances
        self.truncates = zeros(torch.bool)
        self.slot_idx = zeros(torch.long)  # bank position per row, -1 for none
        self.logprobs = zeros(torch.float32)  # the step's output beside its tokens, which go to ``last``
        self.top_ids: dict[int, torch.Tensor] = {}  # k -> (rows, k): each row's k best token ids ...
        self.top_lps: dict[int, torch.Tensor] = {}  # ... and their logprobs, for rows asking top-k
        self.tile_tables: dict[int, RowTiles] = {}  # tiles -> the segmented LoRA kernels' tables

    def tiles(self, positions: list[int]) -> RowTiles:
        """The rows' tile tables in persistent buffers: as many tiles as the rows need, rounded up
        to a power of two (unused tiles do nothing), so that few tile counts, each its own graph,
        serve every mix of adapters."""
        count = 1 << max(0, lora_segments.tiles_needed(positions) - 1).bit_length()
        table = lora_segments.tile_table(positions, tiles=count)
        held = self.tile_tables.get(count)
        if held is None:
            held = self.tile_tables[count] = lora_segments.tables_on(table, self.last.device)
        else:
            for buf, src in zip((held.order, held.slot, held.first, held.count), table):
                buf.copy_(torch.from_numpy(src))
        return held

    def top_buffers(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The persistent (rows, k) outputs of a step keeping each row's ``k`` best logprobs."""
        if k not in self.top_ids:
            self.top_ids[k] = torch.zeros(self.rows, k, dtype=torch.long, device=self.last.device)
            self.top_lps[k] = torch.zeros(self.rows, k, dtype=torch.float32, device=self.last.device)
        return self.top_ids[k], self.top_lps[k]

    def load(self, batch: Any, n: int, slot_idx: torch.Tensor | None, truncates: torch.Tensor | None) -> None:
        """Copy a decode batch's ``n`` rows in; the rest become inert padding rows."""
        for buf, src, pad in ((self.last, batch.last, 0), (self.keys, batch.keys, 0), (self.steps, batch.steps, 0),
                              (self.temperature, batch.temperature, 0.0), (self.top_k, batch.top_k, 0),
                              (self.top_p, batch.top_p, 1.0), (self.slot_idx, slot_idx, -1),
                              (self.truncates, truncates, False), (self.rope, batch.rope_deltas, 0)):
            if src is None:
                buf.fill_(pad)
            else:
                buf[:n].copy_(src)
                buf[n:].fill_(pad)
        self.active[:n].fill_(1)
        self.active[n:].fill_(0)


class DecodeGraphs:
    """Static decode steps of one sampler's model and cache, replayed from CUDA graphs when ``capture``.

    ``capture=False`` runs the very same step eagerly (the CPU reference, and what tests check).
    """

    def __init__(self, model: CausalLM, cache: RowKVCache, *, capture: bool, stats: dict[str, int] | None = None):
        self.model, self.cache = model, cache
        self.capture = capture
        self.device = cache.device
        self.stats = stats if stats is not None else {}
        for name in ("static_steps", "graph_replays", "graph_captures"):
            self.stats.setdefault(name, 0)
        self._inputs: dict[int, StaticInputs] = {}
        self._loaded: tuple[int, Any] | None = None  # (bucket, batch) whose rows the buffers hold
        self._groups: RowSlots | None = None  # the loaded rows' adapters, over the persistent bank index
        # Per variant and span: the static step reads K/V up to the cache's capacity, which grows
        # (a paged cache's pages keep their addresses, so its graphs of shorter spans stay valid).
        self._graphs: dict[tuple[Variant, int], torch.cuda.CUDAGraph] = {}
        self.broken: str | None = None  # why a capture failed: the sampler decodes eagerly from then on
        self._layout: tuple | None = None  # addresses the captured graphs read
        self._bank_check: tuple[int, int] | None = None  # (adapters epoch, slot table version) last synced
        self._bank_layout: tuple = ()
        self._pool = None
        self._side = None
        self.peers: Peers | None = None  # set by a tensor-parallel sampler

    # ----------------------------------------------------------------------------- rows
    def refusal(self, rows: int) -> str | None:
        """Why a batch of ``rows`` rows cannot take the static step (None: it can)."""
        if self.broken is not None:
            return f"the decode step could not be captured ({self.broken})"
        if bucket_for(rows) is None:
            return f"more rows than the largest bucket ({BUCKETS[-1]})"  # no count: logged once, not once per count
        return None

    def burst(self, batch: Any, slots: list[int | None], n: int, k: int, top: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run ``k`` static decode steps for the ``n`` live rows of ``batch``; (n, k) tokens and
        logprobs, and per step every row's ``top`` best (ids, logprobs), (n, top) each, when some
        row asks for top-k sample logprobs (``top`` the most one asks; else an empty list).

        The cache must already hold ``bucket_for(n)`` rows and the burst's positions. ``batch``'s
        ``last`` and ``steps`` are advanced as the eager path advances them.
        """
        B = bucket_for(n)
        assert B is not None and B <= self.cache.row_capacity, "the sampler sizes the cache for the bucket first"
        inputs = self._inputs.get(B)
        if inputs is None:
            inputs = self._inputs[B] = StaticInputs(B, self.device)
        if self._loaded is None or self._loaded[0] != B or self._loaded[1] is not batch:
            rows = (RowSlots.of(self.model, slots + [None] * (B - n), self.device, tiled=False)
                    if any(s is not None for s in slots) else None)
            truncates = None if batch.kinds.truncating is None else torch.zeros(n, dtype=torch.bool, device=self.device)
            if truncates is not None:
                truncates[batch.kinds.truncating] = True
            inputs.load(batch, n, None if rows is None else rows.idx[:n], truncates)
            # The layers read the bank positions (and tiles) from persistent buffers, not from ``rows``.
            tiles = None
            if rows is not None and lora_segments.wanted(self.device):
                tiles = inputs.tiles([-1 if s is None else rows.table.positions[s] for s in rows.slots])
            self._groups = None if rows is None else RowSlots(rows.table, inputs.slot_idx, rows.slots, tiles)
            self._loaded = (B, batch)
        else:  # the same rows: only what the eager path may have advanced meanwhile
            inputs.last[:n].copy_(batch.last)
            inputs.steps[:n].copy_(batch.steps)
        groups = self._groups
        variant = Variant(B, groups is not None, batch.kinds.truncating is not None, batch.kinds.all_greedy, top,
                          0 if groups is None or groups.tiles is None else groups.tiles.tiles)

        def step() -> None:
            self._step(inputs, groups, variant)

        toks, lps, tops = [], [], []
        replays = self.stats["graph_replays"]
        for _ in range(k):
            self._run(variant, step, groups)
            toks.append(inputs.last[:n].clone())
            lps.append(inputs.logprobs[:n].clone())
            if top:
                ids, vals = inputs.top_buffers(top)
                tops.append((ids[:n].clone(), vals[:n].clone()))
        if self.peers is not None and self.stats["graph_replays"] > replays:
            self.peers.fence()
        self.stats["static_steps"] += k
        batch.last, batch.steps = toks[-1], inputs.steps[:n].clone()
        return torch.stack(toks, 1), torch.stack(lps, 1), tops

    def _step(self, inputs: StaticInputs, groups: RowSlots | None, variant: Variant) -> None:
        """One decode step that reads and writes only fixed addresses (what a graph records)."""
        cache = self.cache
        B = inputs.rows
        # The rows' positions (padding rows at 0), pages and key counts: one kernel on a GPU.
        attend = cache.decode_attention(B, cache.capacity, live=inputs.active, rope=inputs.rope)
        hidden = self.model.hidden_states(inputs.last[:, None], attend.positions[:, None], groups, attend=attend,
                                          within_context=True)  # the sampler holds every row to the context
        logits = self.model.logits(hidden[:, 0], groups, fp32=False)  # the token choice widens them
        cache.lengths[:B].add_(inputs.active)
        u = KeyedUniforms(inputs.keys, inputs.steps)  # hashed inside the token-choice kernel where it runs
        # The chosen tokens go straight to ``last``, the next step's input and the step's output.
        _, _, best = choose_tokens_masked(logits, inputs.temperature, inputs.top_k, inputs.top_p, u,
                                          inputs.truncates if variant.truncating else None, variant.all_greedy,
                                          variant.top, out=(inputs.last, inputs.logprobs))
        if best is not None:
            ids, vals = inputs.top_buffers(variant.top)
            ids[:, : best.indices.shape[1]].copy_(best.indices)
            vals[:, : best.values.shape[1]].copy_(best.values)
        inputs.steps.add_(1)

    # ----------------------------------------------------------------------------- graphs
    def _run(self, variant: Variant, step, groups: RowSlots | None) -> None:
        """One step: replay its graph, or run it (and capture the graph right after when none is held)."""
        if not self.capture or self.broken is not None:  # a capture failed earlier in this burst
            step()
            return
        self._drop_stale_graphs(groups)
        key = (variant, self.cache.capacity)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            self.stats["graph_replays"] += 1
            return
        # The first step of a variant runs for real on a side stream (that warms up cuBLAS
        # workspaces and compiles Triton kernels outside the capture), then the graph is recorded:
        # recording executes nothing, so no state moves twice.
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                step()
        except Exception as exc:  # a host read or an uncapturable kernel inside the model
            log.warning("the decode step (%s) cannot be captured as a CUDA graph; decoding eagerly from now on",
                        variant, exc_info=True)
            self.broken = f"{type(exc).__name__}: {str(exc)[:200]}"
        if self.peers is not None and not self.peers.all_ok(self.broken is None) and self.broken is None:
            log.warning("the decode step (%s) could not be captured on another tensor-parallel rank; "
                        "decoding eagerly from now on", variant)
            self.broken = "another tensor-parallel rank's capture failed"
        if self.broken is not None:
            self._forget_graphs()
            return
        self._graphs[key] = graph
        self.stats["graph_captures"] += 1

    def _side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _drop_stale_graphs(self, groups: RowSlots | None) -> None:
        """Forget every graph when an address they read moved (cache reallocated, bank regrown)."""
        layout = (*self.cache.addresses(), self._banks(groups))
        if layout != self._layout:
            self._forget_graphs()
            self._layout = layout

    def _forget_graphs(self) -> None:
        """Drop every graph and the memory pool they shared; the next capture starts a new pool.

        A pool whose graphs are all gone cannot take another capture while it still caches
        blocks (PyTorch's allocator asserts on it), and its blocks serve no other allocation:
        so a new pool handle, and the old pool's blocks handed back to the allocator.
        """
        had_pool = self._pool is not None and bool(self._graphs)
        self._graphs.clear()
        self._pool = None
        if had_pool:
            torch.cuda.empty_cache()  # frees the released pool's cached blocks (rare: a layout change)

    def _banks(self, groups: RowSlots | None) -> tuple:
        """Bring every adapter bank up to date (a replay runs no Python, so no layer syncs its own)
        and return what a graph depends on: which layers hold adapters, their banks' addresses and ranks."""
        if groups is None:
            return self._bank_layout
        check = (adapters_epoch(), groups.table.version)
        if check != self._bank_check:
            self._bank_layout, self._bank_check = sync_banks(self.model, groups), check
        return self._bank_layout
