"""Continuous-batching sampler for one base model and all of its adapters.

Requests of many tenants (each naming an adapter slot, or none for the base model) decode
together. ``step`` admits waiting requests between decode steps (prefilling each prompt once
for all of its ``num_samples`` copies), runs decode steps until its time budget is spent, and
returns the requests that finished. Finished sequences leave the batch at once.

A prompt longer than ``prefill_chunk_tokens`` is prefilled a chunk per scheduler step, each
chunk attending to the K/V of the chunks before it, with decode steps of the running rows in
between: one long prompt never stalls the batch for its whole prefill.

Under a K/V budget, rows are admitted by what they hold; when they outgrow it, the newest
request is preempted (its rows leave, keeping their tokens) and resumes ahead of the queue with
its K/V recomputed, so results equal an uninterrupted run.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from tinsmith import device_memory
from tinsmith.errors import CapacityError, InvalidInputError, TinsmithError
from tinsmith.models.layers import CausalLM, masked_attention
from tinsmith.models.lora import RowGroups, Segments, decode_rows
from tinsmith.models.lora_bank import RowSlots
from tinsmith.models.moe import capture_blocker
from tinsmith.models.vision import VisionTower
from tinsmith.sampling.cancel import CancelBoard, SampleCancelled
from tinsmith.sampling.decode_graphs import DecodeGraphs, bucket_for
from tinsmith.sampling.kv_cache import BLOCK as KV_BLOCK
from tinsmith.sampling.kv_cache import KVTally, RowKVCache, RowNeed, recording_attention
from tinsmith.sampling.paged_kv_cache import PagedKVCache
from tinsmith.sampling.recurrent_state import PrefillStates
from tinsmith.sampling.logits import KeyedUniforms, RowKinds, choose_tokens, draw_per_row, fold_seed, row_keys, uniforms
from tinsmith.sampling.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from tinsmith.sampling.prompt_states import PromptSnapshot, PromptSnapshots
from tinsmith.sampling.stops import StopSpec, StringStopWatcher, stop_spec
from tinsmith.transfers import HostCopies, to_device
from tinsmith.types import SampledSequence, SampleInput, SampleResult

TOPK_SENTINEL = -99999.0
DEVICE_DECODE_BURST = 4  # decode steps per host read-back on a GPU
# Prompt tokens per prefill chunk when none is configured: on a GPU a chunk this size keeps the
# matmuls large; a CPU computes far fewer tokens per second, so its chunks are shorter.
DEFAULT_PREFILL_CHUNK_TOKENS = {"cuda": 2048, "cpu": 512}
# Hybrid models: a beginning at least this long, shared with a kept prompt or another prompt of a
# prefill, is prefilled once and kept (see Sampler._branch_heads).
BRANCH_MIN_TOKENS = 64
# Dense models keep whole prompts' tails and last logits (tinsmith.sampling.prompt_states) in
# this share of the prefix cache's budget, beside it: a prompt's tail is at most a block of K/V,
# and its logits one row of the vocabulary in fp32 (0.6 MB at 151,936 entries).
TAIL_BUDGET_SHARE = 4
# Decode steps a request waits for a row, while its key holds less than its fair share of rows
# (max_rows over the keys with work) and others hold more, before rows are taken back for it
# (the other keys' newest requests preempted, resumed after it): a key that filled every row
# with long generations would otherwise keep a newcomer waiting until one of them ends.
FAIR_SHARE_WAIT_STEPS = 64
KV_LAYOUTS = ("auto", "paged", "rows")  # the K/V cache's layout: auto is paged on CUDA, per-row buffers elsewhere
_ALT_STREAM = 0x6A09E667F3BCC909  # XORed into the seed: prompt_alt_tokens draws get their own stream

log = logging.getLogger(__name__)
# A request's first sampled token for each of its rows: tokens, their logprobs, top logprobs (or None).
_FirstTokens = tuple[list[int], list[float], list]


@dataclass
class SampleTask:
    key: Any  # opaque to the sampler (the engine's job)
    slot: int | None  # adapter slot to sample with; None = base model
    input: SampleInput
    owner: str | None = None  # who asked (an API key): waiting requests share rows fairly among owners
    queued_at: float = 0.0  # perf_counter when it reached this sampler (set by ``add``): its wait for a row
    queued_step: int = 0  # the sampler's decode steps when it arrived: its wait, alike on every rank


@dataclass
class _TaskState:
    task: SampleTask
    stops: StopSpec
    max_tokens: int
    seed: int
    sequences: list[SampledSequence | None]
    prompt_logprobs: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_lps: np.ndarray | None = None
    target_lps: np.ndarray | None = None
    alt_tokens: np.ndarray | None = None
    alt_lps: np.ndarray | None = None
    remaining: int = 0
    cached_tokens: int = 0  # prompt positions whose K/V came from the prefix cache or another request
    rope_delta: int = 0  # multimodal RoPE: decoded token i sits at position len(prompt) + i + rope_delta
    order: int = 0  # admission order: the newest requests are preempted first
    paused: list[_Row] = field(default_factory=list)  # rows taken off the batch to free K/V, to resume
    yielded: bool = False  # its paused rows were taken for a key below its fair share (not for K/V)
    head: PromptSnapshot | None = None  # hybrid models: the kept prompt its prefill continues from
    computed_head: bool = False  # its head is a shared beginning computed in its own prefill, not a cached one


@dataclass
class _Row:
    state: _TaskState
    sample_idx: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)
    watcher: StringStopWatcher | None = None
    group: object = None  # the rows seeded from one prefill of its prompt (a paged cache holds it once)


@dataclass
class _Burst:
    """A decode burst queued on the device: its rows (the batch's, in order, when it was queued),
    its steps, each row's top-k ask, the rows that ask (None: none), and its outputs on their
    way to the host (tokens, logprobs, and the asking rows' best ids and logprobs per step)."""

    rows: list[_Row]
    k: int
    asks: list[int]
    asking: list[int] | None
    out: HostCopies


def _capturable(model: CausalLM) -> bool:
    """Whether ``model``'s decode step can be replayed from CUDA graphs; if not, the log says why."""
    why = capture_blocker(model)
    if why is not None:
        log.info("decode steps run eagerly, without CUDA graphs: %s", why)
    return why is None


class Sampler:
    # Errors that end the sampler rather than the requests of one step (a failed tensor-parallel
    # collective: the ranks are out of step, no later step could run).
    fatal_errors: tuple[type[BaseException], ...] = ()

    def __init__(
        self,
        model: CausalLM,
        decode: Callable[[list[int]], str],
        *,
        max_rows: int = 256,
        prefill_tokens: int = 8192,
        cancellations: CancelBoard | None = None,
        vision: VisionTower | None = None,
        decode_burst: int | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        kv_cache_bytes: int | None = None,
        cuda_graphs: bool = False,
        prefill_chunk_tokens: int | None = None,
        kv_layout: str = "auto",
        keep_cache_when_idle: bool = False,
        run_ahead: bool | None = None,
    ):
        self.model = model
        self.vision = vision  # image-text models: turns prompt images into their tokens' features
        # An idle sampler gives its K/V memory back at once (False), or keeps it for the next
        # burst until :meth:`release_memory` is called (True: whoever owns the sampler calls it when
        # the device runs short). Kept, the cache's buffers stay where they are, and so do the CUDA
        # graphs captured over them: an RL loop's next sampling phase neither regrows the cache
        # nor captures its graphs again.
        self.keep_cache_when_idle = keep_cache_when_idle
        # Set by the owner of several samplers: have the others give back what they keep idle
        # (bytes released), tried when a prefill runs out of memory.
        self.release_elsewhere: Callable[[], int] | None = None
        self.cfg = model.config
        self.decode = decode
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # Decode steps per read-back of the sampled tokens (see _decode_step). On a CPU every
        # operation has finished when it returns, so reading back each step costs nothing and a
        # burst would only decode past stops; on a GPU a burst keeps the launch queue full.
        self.decode_burst = decode_burst or (DEVICE_DECODE_BURST if self.device.type == "cuda" else 1)
        # Queue the next burst before reading the last one (see _decode_step): on a GPU the device
        # decodes while the host records tokens. A CPU does the host's work and the device's in
        # turn, so there it would only decode a burst past rows' ends (tests turn it on).
        self.run_ahead = (self.device.type == "cuda") if run_ahead is None else run_ahead
        self._deadline = 0.0  # when the current step()'s time slice ends (0 outside step: no running ahead)
        self._arrivals: Callable[[], bool] | None = None  # the current step()'s arrivals (see step)
        self.kv_cache_bytes = kv_cache_bytes if kv_cache_bytes is not None else _default_kv_bytes(self.device)
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={kv_layout!r}: choose one of {', '.join(KV_LAYOUTS)}")
        # Paged on a GPU (the decode kernels read pages through the table); per-row buffers on a CPU,
        # where reading pages would gather them into row buffers at every step.
        self.paged_kv = kv_layout == "paged" or (kv_layout == "auto" and self.device.type == "cuda")
        self.cache = self._new_cache()
        # Attention layer -> its index in prefill K/V buffers and prefix blocks (hybrid models'
        # Gated DeltaNet layers keep no K/V).
        attention = [i for i in range(self.cfg.num_layers) if not self.cfg.is_linear_layer(i)]
        self._kv_index = {layer: i for i, layer in enumerate(attention)}
        reuse = model.supports_prefix_reuse and self.cfg.supports_prefix_cache  # hybrids: recurrent state
        self._prefix_bytes = prefix_cache_bytes if reuse else 0
        self.prefix = self._new_prefix_cache()
        # Hybrid models keep whole prompts' prefill results instead (the same budget): a prompt
        # sent again in a later admission (GRPO as separate requests) is not prefilled again.
        # Dense models keep what the blocks lack of such a prompt, its tail and last logits, so
        # that it skips even the forward pass over its last token.
        self.snapshots = PromptSnapshots(prefix_cache_bytes if self.cfg.has_recurrent_state
                                         else self._prefix_bytes // TAIL_BUDGET_SHARE)
        # A prompt longer than this is prefilled in chunks (0: never). Later chunks run over the K/V
        # of earlier ones, as a prefix-cache hit does; hybrid models carry their recurrent states
        # from chunk to chunk.
        self.prefill_chunk_tokens = (prefill_chunk_tokens if prefill_chunk_tokens is not None
                                     else DEFAULT_PREFILL_CHUNK_TOKENS.get(self.device.type, 2048))
        self._can_chunk = model.supports_prefix_reuse and self.prefill_chunk_tokens > 0
        self._chunked: _ChunkedPrefill | None = None  # the long prompt being prefilled, a chunk per step
        # Equal prompts admitted together share one prefill whenever the cache is not turned off:
        # that needs no kept K/V, so hybrid models (whose prefix K/V are not reused) do it too.
        self.share_prompts = prefix_cache_bytes > 0
        self.inbox: deque[SampleTask] = deque()
        self._waited: set[int] = set()  # ids of queued requests that waited once for a prefill's blocks
        self._inbox_ordered: tuple | None = None  # what the inbox was last put in fair order for
        self._resume: deque[_TaskState] = deque()  # preempted requests: admitted again before the inbox
        self._admissions = itertools.count(1)
        self.rows: list[_Row] = []
        self._decode_batch: _DecodeBatch | None = None
        self.cancellations = cancellations
        self._cancel_version = 0  # the board's version last acted on
        self._failed: list[tuple[Any, Exception]] = []  # failed between steps; reported by the next one
        self.stats = {"decode_steps": 0, "decode_reads": 0, "prefills": 0, "prefill_tokens": 0,
                      "cached_prompt_tokens": 0, "sampled_tokens": 0, "cancelled": 0, "prefill_chunks": 0,
                      "preempted": 0, "recomputed_tokens": 0, "admissions": 0, "admission_wait_s": 0.0,
                      "admitting_s": 0.0,
                      "yielded_rows": 0, "bursts_ahead": 0,
                      "rows_left_ahead": 0, "slices_ended_for_arrivals": 0}
        # Static decode steps replayed from CUDA graphs (only on CUDA: on a CPU nothing is
        # launch-bound, and the padded, full-capacity step only costs more there).
        self.graphs = (DecodeGraphs(model, self.cache, capture=True, stats=self.stats)
                       if cuda_graphs and self.device.type == "cuda" and _capturable(model) else None)
        self._eager_reasons: set[str] = set()  # why batches stayed off the static step, each logged once

    def _new_cache(self) -> RowKVCache:
        """The K/V cache for ``self.cfg`` (a sharded sampler's heads), in the chosen layout."""
        if self.paged_kv:
            return PagedKVCache(self.cfg, self.device, self.dtype, max_bytes=self.kv_cache_bytes,
                                table_rows=self.max_rows)
        return RowKVCache(self.cfg, self.device, self.dtype, max_bytes=self.kv_cache_bytes)

    def _new_prefix_cache(self) -> PrefixCache:
        """The prefix cache over ``self.cache``: its blocks are the cache's pages when it is paged
        (a page each; the layers beside the pages keep their part of a block as a tensor)."""
        if isinstance(self.cache, PagedKVCache):
            rowwise = [j for layer, j in self._kv_index.items() if self.cache.rowwise(layer)]
            return PrefixCache(self._prefix_bytes, PagedKVCache.page, self.cache, rowwise)
        return PrefixCache(self._prefix_bytes)

    # ----------------------------------------------------------------------------- public
    def add(self, task: SampleTask) -> None:
        """Queue a request (thread-safe); it joins the batch at the next step."""
        task.queued_at = task.queued_at or time.perf_counter()
        task.queued_step = self.stats["decode_steps"]
        self.inbox.append(task)

    def has_work(self) -> bool:
        return bool(self.inbox or self.rows or self._chunked or self._resume or self._failed)

    def fail_slot(self, slot: int, exc: Exception) -> None:
        """Fail the queued and running requests that read adapter ``slot`` (it is being taken off
        the model: without this they would go on sampling the base weights); the next
        :meth:`step` reports them."""
        for task in [t for t in list(self.inbox) if t.slot == slot]:
            self.inbox.remove(task)
            self._failed.append((task.key, exc))
        states = [s for s in self._live_states() if s.task.slot == slot]
        if states:
            self._fail(states, exc, self._failed)

    def slots_in_use(self) -> set[int]:
        """Adapter slots that queued or running requests read (must not be unloaded)."""
        used = {s.task.slot for s in self._live_states()} | {t.slot for t in list(self.inbox)}
        return {s for s in used if s is not None}

    def _live_states(self) -> list[_TaskState]:
        """Every admitted request not yet finished, once each: those with decoding rows, the one
        whose prompt is being prefilled in chunks, and the preempted ones waiting to resume."""
        live = {id(r.state): r.state for r in self.rows}
        if self._chunked is not None:
            live[id(self._chunked.state)] = self._chunked.state
        live.update((id(st), st) for st in self._resume)
        return list(live.values())

    def running(self):
        """``(key, sample_index, tokens so far)`` of every sequence still decoding.

        For progress reports (streaming) between steps: the token lists are the live ones,
        so a caller that keeps them must copy them before the next step.
        """
        for row in self.rows:
            yield row.state.task.key, row.sample_idx, row.tokens

    def step(self, budget_s: float = 0.05,
             arrivals: Callable[[], bool] | None = None) -> list[tuple[Any, SampleResult | Exception]]:
        """Admit waiting requests, decode until ``budget_s`` is spent; return finished requests.

        ``arrivals`` says whether requests wait to be handed to this sampler from outside (the
        engine hands them over between slices): when they do, the slice ends after the burst
        under way, and no burst is queued ahead, so they join after a burst rather than after
        the rest of the slice.

        A request's result is an exception when it failed: a ``TinsmithError`` for bad input,
        anything else (out of memory ...) for the requests that were in the failing step.
        """
        done: list[tuple[Any, SampleResult | Exception]] = self._failed
        self._failed = []
        deadline = time.perf_counter() + budget_s
        self._deadline = deadline
        self._arrivals = arrivals
        try:
            with torch.inference_mode():
                self._drop_cancelled(done)
                self._admit(done)
                # One scheduler step: the next chunk of a long prompt (if one is being prefilled),
                # then a decode burst of the running rows, then admission of waiting requests.
                while (self.rows or self._chunked) and self._go_on(deadline, done):
                    if self._chunked is not None:
                        self._prefill_next_chunk(done)
                    if self.rows:
                        self._make_room()
                        try:
                            self._decode_step(done)
                        except self.fatal_errors:
                            raise
                        except Exception as exc:  # e.g. out of memory: no row can go on, but the sampler can
                            log.exception("decode step failed; failing the %d requests in the batch", len(self.rows))
                            self._fail(list({id(r.state): r.state for r in self.rows}.values()), exc, done)
                            break
                    if self.inbox and len(self.rows) < self.max_rows:
                        self._admit(done)
                    if arrivals is not None and arrivals():
                        self.stats["slices_ended_for_arrivals"] += 1
                        break
                if not self.rows and not self.keep_cache_when_idle:
                    self.cache.shrink(0, 1)
        finally:
            self._deadline = 0.0
            self._arrivals = None
        return done

    def release_memory(self) -> int:
        """Give back what an idle sampler keeps on the device: its K/V buffers beyond their
        initial size and its prefix cache (the device is short of memory elsewhere). Returns the
        bytes released; a sampler with work releases nothing."""
        if self.has_work():
            return 0
        before = self.cache.nbytes() + self.prefix.bytes + self.snapshots.bytes
        self.prefix.clear()
        self.snapshots.clear()
        with torch.inference_mode():
            self.cache.shrink(0, 1)
        return before - self.cache.nbytes()

    def _go_on(self, deadline: float, done: list) -> bool:
        """Whether to run another decode step in this :meth:`step` (its time budget is not spent);
        cancelled requests leave the batch first. A tensor-parallel sampler agrees on both with
        the other ranks (:class:`tinsmith.parallel.sampling.LockstepSampler`)."""
        if time.perf_counter() >= deadline:
            return False
        self._drop_cancelled(done)
        return True

    # ----------------------------------------------------------------------------- admission
    def _validate(self, task: SampleTask) -> _TaskState:
        inp = task.input
        P, V, ctx = len(inp.prompt), self.cfg.vocab_size, self.cfg.max_position_embeddings
        if P == 0:
            raise InvalidInputError("prompt must hold at least one token")
        if inp.prompt_images and self.vision is None:
            raise InvalidInputError("this model takes no image input")
        if int(np.min(inp.prompt)) < 0 or int(np.max(inp.prompt)) >= V:
            raise InvalidInputError(f"prompt has token ids outside [0, {V}) (vocab size {V})")
        if inp.num_samples < 1 or inp.num_samples > self.max_rows:
            raise InvalidInputError(f"num_samples={inp.num_samples} must be in 1..{self.max_rows}")
        max_tokens = inp.params.max_tokens if inp.params.max_tokens is not None else ctx - P
        if max_tokens < 1 or P + max_tokens > ctx:
            raise InvalidInputError(
                f"sampling_params.max_tokens={inp.params.max_tokens}: prompt ({P} tokens) + max_tokens must fit "
                f"the model's context of {ctx} tokens (and max_tokens must be >= 1)"
            )
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            k = getattr(inp, name)
            if not 0 <= k <= V:  # the result holds (length, k) arrays: an unbounded k exhausts memory
                raise InvalidInputError(f"{name}={k} must be in 0..{V} (the vocabulary size)")
        ids = inp.target_prompt_ids
        if ids is not None:
            if ids.shape[0] != P - 1:
                raise InvalidInputError(f"target_prompt_logprobs has {ids.shape[0]} rows; len(prompt) - 1 = {P - 1}")
            if int(ids.max()) >= V:
                raise InvalidInputError(f"target_prompt_logprobs has token ids outside [0, {V}) (vocab size {V})")
            if ids.shape[1] > V:  # bounded like a top-k width: more columns than the vocabulary is waste
                raise InvalidInputError(f"target_prompt_logprobs has {ids.shape[1]} columns, more than the vocabulary ({V})")
        p = inp.params
        if p.temperature < 0 or not math.isfinite(p.temperature):
            raise InvalidInputError(f"sampling_params.temperature={p.temperature} must be >= 0")
        if not (0 < p.top_p <= 1):
            raise InvalidInputError(f"sampling_params.top_p={p.top_p} must be in (0, 1]")
        seed = fold_seed(p.seed) if p.seed is not None else fold_seed(secrets.randbits(64))
        stops = stop_spec(p.stop, self.cfg.eos_token_ids)
        if stops.token_ids and max(stops.token_ids) >= V:
            raise InvalidInputError(f"sampling_params.stop has token ids outside [0, {V})")
        return _TaskState(task, stops, max_tokens, seed, [None] * inp.num_samples, remaining=inp.num_samples)

    def _longest(self, inp: SampleInput) -> int:
        """Positions a request's rows may reach: prompt + max_tokens (at most the context)."""
        ctx, P = self.cfg.max_position_embeddings, len(inp.prompt)
        return min(ctx, P + (inp.params.max_tokens if inp.params.max_tokens is not None else ctx - P))

    def _held(self, inp: SampleInput, sampled: int) -> int:
        """Positions admission counts a row at: what it holds after ``sampled`` tokens plus a block of
        room to grow, at most its longest. Image prompts' rows count at their longest (they are
        never preempted: their recomputation would need their images' positions again)."""
        if inp.prompt_images:
            return self._longest(inp)
        return min(self._longest(inp), len(inp.prompt) + sampled + KV_BLOCK)

    def _need(self, r: int, positions: int) -> RowNeed:
        """Row ``r`` at ``positions``: the pages it holds (shared with any row holding them), its
        prompt shared with the rows of its group."""
        row = self.rows[r]
        return RowNeed(positions, row.group, len(row.state.task.input.prompt) if row.group is not None else 0,
                       self.cache.held_pages(r))

    def _prompt_need(self, task: SampleTask, key: tuple | None, positions: int, group: object, chunked: bool) -> RowNeed:
        """A row of ``task`` (its :meth:`_share_key` ``key``) not yet admitted at ``positions``,
        sharing its prompt within ``group`` and the pages the prefix cache holds of it (its
        prefill's rows hold them: not a prompt prefilled in chunks, which writes pages of its own)
        with any row holding them."""
        inp = task.input
        pages: tuple[int, ...] = ()
        if self.prefix.pool is not None and key is not None and not chunked and not _needs_prompt_logits(inp):
            pages = tuple(self.prefix.pages_of(self.prefix.peek(key[0], np.asarray(inp.prompt).tolist(), len(inp.prompt))))
        return RowNeed(positions, group, len(inp.prompt), pages)

    def _occupancy(self) -> list[RowNeed]:
        """What each running row, and each row of the prompt being chunked, is counted at by
        admission (the cache says what rows of those take: :meth:`RowKVCache.bytes_for`)."""
        needs = [self._need(i, self._held(r.state.task.input, len(r.tokens))) for i, r in enumerate(self.rows)]
        if self._chunked is not None:  # it holds its rows already: they decode once its last chunk is done
            inp = self._chunked.state.task.input
            needs += [RowNeed(self._held(inp, 0), id(self._chunked.state), len(inp.prompt))] * inp.num_samples
        return needs

    def _admit(self, done: list) -> None:
        if not self._resume and not self.inbox:  # nothing waits: no need to count what the rows hold
            self._waited.clear()
            return
        self._order_inbox()
        batch: list[_TaskState] = []
        # Rows are counted at what they hold plus room to grow (_held); when they outgrow the K/V
        # budget the newest requests are preempted (_make_room) and resume later.
        spans = self.cache.tally(self._occupancy())
        i = 0
        while i < len(self._resume):  # preempted requests come back first, oldest first
            st = self._resume[i]
            if st.yielded and self._behind_in_turn(st):
                i += 1  # it gave its rows to a key holding fewer, whose request goes first
                continue
            n = len(st.paused)
            need = [RowNeed(self._held(st.task.input, len(r.tokens))) for r in st.paused]  # each recomputed alone
            over_budget = self.kv_cache_bytes and spans.bytes(need) > self.kv_cache_bytes
            if spans.rows and (spans.rows + n > self.max_rows or over_budget):
                return  # nothing overtakes a preempted request
            del self._resume[i]
            self._resume_rows(st, done)
            spans.add(need)
        if self._yield_rows(spans):
            spans = self.cache.tally(self._occupancy())
        waiting: list[SampleTask] = []
        try:
            batch = self._admit_inbox(done, spans, waiting)
        finally:  # the requests that wait keep their place at the head of the queue
            self.inbox.extendleft(reversed(waiting))
            if not self.inbox:
                self._waited.clear()
        if batch:
            started = time.perf_counter()
            try:
                before = len(self.rows)
                try:
                    self._prefill(batch, done)
                except torch.OutOfMemoryError:
                    if len(self.rows) != before or not self._give_memory_up("in a prefill"):
                        raise
                    self._prefill(batch, done)
            except self.fatal_errors:
                raise
            except Exception as exc:  # e.g. out of memory: fail these requests, keep the running ones
                log.exception("prefill of %d requests failed", len(batch))
                self._fail(batch, exc, done)
            finally:  # the host's time for it, the first tokens' read-back included: decoding waits
                self.stats["admitting_s"] += time.perf_counter() - started

    def _order_inbox(self) -> None:
        """Put the waiting requests of several owners in the order that shares rows among them.

        Each waiting request is placed at the row its owner would reach with it: the rows the
        owner holds already (decoding, prefilling, preempted) plus the rows of its requests
        waiting ahead of it; the lowest place goes first, ties in arrival order. An owner's own
        requests keep their order. So a key that sends one request while another key has
        hundreds queued is admitted at the next free row, not behind the whole queue, and keys
        with work take rows in turns. (Only the order changes: the head still waits for rows
        and K/V to free up, and nothing overtakes it, so a large request is never starved.)
        """
        if len(self.inbox) < 2:
            return
        waiting = list(self.inbox)  # a copy: ``add`` may append meanwhile (appended ones stay last)
        first = waiting[0].owner
        if all(t.owner == first for t in waiting):
            return
        place = _rows_by_owner(self._live_states())
        seen = (len(waiting), id(waiting[0]), id(waiting[-1]), frozenset(place.items()))
        if seen == self._inbox_ordered:  # ordered already for these rows (admission tried again)
            return
        self._inbox_ordered = seen
        order = []
        for i, task in enumerate(waiting):
            order.append((place[task.owner], i))
            place[task.owner] += task.input.num_samples
        order.sort()
        if all(i == j for j, (_, i) in enumerate(order)):
            return
        for _ in waiting:
            self.inbox.popleft()
        self.inbox.extendleft(reversed([waiting[i] for _, i in order]))

    def _behind_in_turn(self, st: _TaskState) -> bool:
        """Whether the request at the head of the queue is of a key holding fewer rows than
        ``st``'s key holds without the rows ``st`` yielded (see :meth:`_yield_rows`)."""
        if not self.inbox or self.inbox[0].owner == st.task.owner:
            return False
        held = _rows_by_owner(self._live_states())
        return held[self.inbox[0].owner] < held[st.task.owner] - len(st.paused)

    def _yield_rows(self, spans: KVTally) -> bool:
        """Take rows back for the request at the head of the queue when every row is taken, it has
        waited :data:`FAIR_SHARE_WAIT_STEPS` decode steps, and its key holds less than its fair
        share (``max_rows`` over the keys with work) even with it: the newest requests of the keys
        holding the most rows above their share give back just the rows it needs (never taking a
        key below its share), and resume after it, each row where it stopped (:meth:`_preempt`).
        Decided from counts every tensor-parallel rank holds alike. Whether rows were taken."""
        if not self.inbox:
            return False
        head = self.inbox[0]
        n = head.input.num_samples
        short = n - (self.max_rows - spans.rows)
        if short <= 0 or n > self.max_rows or self.stats["decode_steps"] - head.queued_step < FAIR_SHARE_WAIT_STEPS:
            return False
        live = self._live_states()
        owners = {st.task.owner for st in live} | {t.owner for t in list(self.inbox)}
        fair = self.max_rows // max(1, len(owners))
        held = _rows_by_owner(live)
        if len(owners) < 2 or held[head.owner] + n > fair:
            return False
        decoding = Counter(id(row.state) for row in self.rows)
        # Candidates: other keys' requests with decoding rows (not image prompts, which are never
        # preempted; a prompt being chunked has none yet).
        candidates = [st for st in {id(r.state): r.state for r in self.rows}.values()
                      if st.task.owner != head.owner and not st.task.input.prompt_images]
        takes: dict[int, tuple[_TaskState, int]] = {}
        while short > 0:
            over = [st for st in candidates if held[st.task.owner] > fair and decoding[id(st)]]
            if not over:
                return False  # the rows above their keys' shares would not be enough: take none
            st = max(over, key=lambda x: (held[x.task.owner], x.order))  # the most rows' key, its newest
            k = min(short, decoding[id(st)], held[st.task.owner] - fair)
            takes[id(st)] = (st, takes.get(id(st), (st, 0))[1] + k)
            decoding[id(st)] -= k
            held[st.task.owner] -= k
            short -= k
        for st, k in takes.values():
            self._preempt(st, k)
            st.yielded = True
            self.stats["yielded_rows"] += k
        return True

    def _admit_inbox(self, done: list, spans: KVTally, waiting: list[SampleTask]) -> list[_TaskState]:
        """Take requests off the inbox for one prefill while rows, the prefill's token budget and
        the K/V budget allow (``spans``: what rows hold already); ``waiting`` gets those that wait
        for this prefill's blocks. Long prompts start their chunked prefill instead."""
        batch: list[_TaskState] = []
        tokens = 0  # prompt tokens this prefill computes (a prompt shared with an earlier request counts once)
        shared: set[tuple] = set()
        # Prompts of this prefill by weights and first BRANCH_MIN_TOKENS tokens: requests sharing a
        # longer beginning with one of them may wait for the next admission (_waits_for_prefill).
        leads: dict[tuple, list[np.ndarray]] = {}
        while self.inbox:
            task = self.inbox[0]
            if batch and bool(task.input.prompt_images) != bool(batch[0].task.input.prompt_images):
                # Image prompts are prefilled whole (positions on their images' grids), and a prefill
                # with any of them computes every prompt whole: text prompts go in a prefill of their
                # own, which reads the prefix cache.
                break
            n = task.input.num_samples
            key = self._share_key(task)
            P = 0 if key is not None and key in shared else len(task.input.prompt)
            if P and batch and self._waits_for_prefill(task, key, leads):
                waiting.append(self.inbox.popleft())
                continue
            chunked = self._prefilled_in_chunks(task)
            head = self._kept_head(task)  # a kept prompt this one equals (or, on hybrid models, extends)
            if head is not None and head.length == len(task.input.prompt):
                chunked, P, head = False, 0, None  # the prefill seeds its rows from the kept one
            elif head is not None and P:
                P -= head.length  # the prefill continues from the kept one: only the new tokens count
            if chunked and self._chunked is not None:
                break  # one long prompt at a time, in queue order
            # A request that can never fit (num_samples > max_rows) goes straight to validation,
            # which rejects it; waiting for rows would block the queue behind it forever.
            fits = n <= self.max_rows
            rows = spans.rows
            if fits and batch and (rows + n > self.max_rows or (not chunked and tokens + P > self.prefill_tokens)):
                break
            if fits and not batch and rows + n > self.max_rows:
                break  # wait for rows to free up
            # The rows of one prefill of a prompt (num_samples, and requests of it admitted together)
            # may hold its K/V once.
            group = ("prompt", key) if key is not None and not chunked and head is None else ("task", id(task))
            need = self._prompt_need(task, key, self._held(task.input, 0), group, chunked)
            held = [need] * n
            alone = self.cache.bytes_for([need._replace(positions=self._longest(task.input))] * n)
            if fits and self.kv_cache_bytes and max(alone, spans.bytes(held)) > self.kv_cache_bytes:
                if batch or rows:
                    break  # wait for running sequences to finish and give their K/V back
                self.inbox.popleft()
                try:
                    self._validate(task)  # bad input gets its own error first
                except TinsmithError as e:
                    done.append((task.key, e))
                    continue
                done.append((task.key, CapacityError(
                    f"this request's {n} sequences of up to {self._longest(task.input)} tokens need "
                    f"{alone} bytes of K/V cache, more than the sampler's "
                    f"{self.kv_cache_bytes} (--sampler-kv-cache-bytes); lower num_samples or max_tokens")))
                continue
            self.inbox.popleft()
            self._waited.discard(id(task))
            try:
                st = self._validate(task)
            except TinsmithError as e:
                done.append((task.key, e))
                continue
            st.order = next(self._admissions)
            self.stats["admissions"] += 1
            self.stats["admission_wait_s"] += time.perf_counter() - task.queued_at
            spans.add(held)
            if chunked:
                self._start_chunked(st, done, head)
                continue
            st.head = head
            batch.append(st)
            tokens += P
            if key is not None:
                shared.add(key)
                if P and len(task.input.prompt) >= BRANCH_MIN_TOKENS and self._keeps_prompts(task):
                    prompt = np.asarray(task.input.prompt, dtype=np.int64)
                    leads.setdefault((key[0], prompt[:BRANCH_MIN_TOKENS].tobytes()), []).append(prompt)
        return batch

    def _waits_for_prefill(self, task: SampleTask, key: tuple | None, leads: dict[tuple, list[np.ndarray]]) -> bool:
        """Whether ``task`` waits for the next admission because a prompt of the prefill being
        formed shares at least ``BRANCH_MIN_TOKENS`` more of its beginning than the prefix cache
        holds: that prefill puts those blocks in the cache, and ``task`` then computes only the
        rest, rather than both computing the beginning (GRPO's prompts behind one system prompt,
        sent together; SGLang's scheduler holds such requests back likewise). Dense models only
        (hybrids prefill a shared beginning once in the same admission: :meth:`_branch_heads`); a
        request waits at most once, so the queue always moves."""
        inp = task.input
        if (key is None or not self.prefix.enabled or id(task) in self._waited or _needs_prompt_logits(inp)
                or len(inp.prompt) <= BRANCH_MIN_TOKENS or not self._keeps_prompts(task)):
            return False
        mine = np.asarray(inp.prompt, dtype=np.int64)
        others = leads.get((key[0], mine[:BRANCH_MIN_TOKENS].tobytes()), [])
        common = max((_common_prefix(mine, t) for t in others), default=0)
        block = self.prefix.block
        blocks = min(common, len(mine)) // block * block  # what the prefill will cache of it
        if blocks - self.prefix.cached_tokens(key[0], mine.tolist(), len(mine)) < BRANCH_MIN_TOKENS:
            return False
        self._waited.add(id(task))
        return True

    def _drop_cancelled(self, done: list) -> None:
        """Drop queued and running requests posted on the cancellation board since the last look:
        their rows leave the batch and their cache rows are freed before the next decode step."""
        board = self.cancellations
        if board is None or board.version == self._cancel_version:
            return
        self._cancel_version = board.version
        if not len(board):
            return
        for task in [t for t in list(self.inbox) if board.wants(t.key)]:
            self.inbox.remove(task)
            done.append((task.key, SampleCancelled("the request was cancelled by its client")))
            self.stats["cancelled"] += 1
        states = [s for s in self._live_states() if board.wants(s.task.key)]
        if states:
            self.stats["cancelled"] += len(states)
            self._fail(states, SampleCancelled("the request was cancelled by its client"), done)

    def abort(self) -> list[Any]:
        """Forget every queued and running request; returns their keys (for the caller to fail)."""
        keys = [t.key for t in self.inbox]
        self.inbox.clear()
        states = self._live_states()
        done: list = []
        self._fail(states, RuntimeError("aborted"), done)
        return keys + [k for k, _ in done]

    def _fail(self, states: list[_TaskState], exc: Exception, done: list) -> None:
        """Drop the rows of ``states`` and report each request not yet reported as failed.

        Without this an unexpected error would leave their rows in the batch, failing every
        later step the same way: sampling on this base model would stop for every tenant.
        """
        ids = {id(s) for s in states}
        if self._chunked is not None and id(self._chunked.state) in ids:
            self._chunked = None  # its partial K/V are dropped with it
        self._resume = deque(st for st in self._resume if id(st) not in ids)
        self._drop_rows([r for r, row in enumerate(self.rows) if id(row.state) in ids])
        for st in states:
            if st.remaining > 0:
                st.remaining = 0
                done.append((st.task.key, exc))
        self._rows_changed()

    def _prefill(self, batch: list[_TaskState], done: list) -> None:
        """Run every admitted prompt once (right-padded, grouped by adapter), seed its rows.

        Requests with the same prompt and weights share one prefill (GRPO sends one prompt as
        many requests); a prompt whose first blocks are in the prefix cache prefills only the
        rest (see :mod:`tinsmith.sampling.prefix_cache`).
        """
        batch.sort(key=lambda s: -1 if s.task.slot is None else s.task.slot)
        lead: list[int] = []  # batch index -> index of the prefill that computes its prompt
        unique: list[_TaskState] = []
        seen: dict[tuple, int] = {}
        for st in batch:
            key = self._share_key(st.task)
            if key is not None and key in seen:
                lead.append(seen[key])
                st.cached_tokens = len(st.task.input.prompt)
                continue
            if key is not None:
                seen[key] = len(unique)
            lead.append(len(unique))
            unique.append(st)
        kept = self._kept_snapshots(unique)  # unique index -> a prompt's kept prefill, made whole
        fresh = [u for u in range(len(unique)) if u not in kept]
        self._branch_heads([unique[u] for u in fresh])
        out = self._forward_prompts([unique[u] for u in fresh]) if fresh else None
        for st, u in zip(batch, lead):  # a request sharing another's prefill: its multimodal positions too
            st.rope_delta = unique[u].rope_delta
        at = {u: i for i, u in enumerate(fresh)}  # unique index -> its row in this prefill
        L = max([out.lens[i] for i in range(len(fresh))] + [snap.length for snap in kept.values()])
        self.stats["prefills"] += len(fresh)
        if out is not None:
            self.stats["prefill_tokens"] += sum(out.lens) - sum(out.starts)
            self._keep_snapshots([unique[u] for u in fresh], out)
        self.stats["cached_prompt_tokens"] += sum(st.cached_tokens for st in batch)

        self._grow_cache(sum(s.task.input.num_samples for s in batch), L + 1)
        shared: dict[int, Any] = {}  # unique prompt -> what its rows share of its K/V (a paged cache's full pages)
        for u, i in at.items():
            if out is not None and out.pages[i]:  # pages of the prefix cache: its rows hold them too
                shared[u] = out.pages[i]
                self.cache.hold(shared[u])
        for u, snap in kept.items():
            if snap.pages:  # a dense prompt's kept tail: its rows hold the prefix cache's pages before it
                shared[u] = snap.pages
                self.cache.hold(shared[u])
        firsts = self._first_tokens(batch, [kept[u].last_logits if u in kept else out.last_logits[at[u]]  # type: ignore[union-attr]
                                            for u in lead])
        requests: dict[int, list[int]] = {}  # unique prompt -> the batch indices of its requests
        for b_idx, u in enumerate(lead):
            requests.setdefault(u, []).append(b_idx)
        finished: list[tuple[int, str]] = []  # rows that end at once, retired once every prompt is stored
        keep: list[tuple] = []  # prompts whose pages the prefix cache adopts, once they hold the K/V
        try:
            with self.cache.writes_together():  # every prompt's K/V stored together (a paged cache)
                for u, idx in requests.items():  # every row of a prompt at once
                    states, first = [batch[b] for b in idx], [firsts[b] for b in idx]
                    if u in kept:
                        snap = kept[u]
                        shared[u] = self._seed_rows(states, None, snap.last_logits, snap.kv, snap.length, done,
                                                    snap.states, 0, shared.get(u), first, finished)
                        continue
                    assert out is not None
                    i = at[u]
                    if _needs_prompt_logits(states[0].task.input):
                        assert out.starts[i] == 0  # such prompts never read the prefix cache
                    layer_kv = {layer: (k[i], v[i]) for layer, (k, v) in out.kv.items()}
                    shared[u] = self._seed_rows(states, out.hidden[i, : out.lens[i]], out.last_logits[i], layer_kv,
                                                out.lens[i], done, out.states, i, shared.get(u), first, finished)
                    if out.cacheable[i]:
                        keep.append((states[0].task, shared[u], layer_kv, out.weights[i]))
            self._retire(finished, done)
            for args in keep:
                self._keep_pages(*args)
        finally:
            for held in shared.values():
                if held:
                    self.cache.let_go(held)
        self._rows_changed()

    def _branch_heads(self, states: list[_TaskState]) -> None:
        """On hybrid models, prompts that continue no kept prompt but share a beginning of at least
        ``BRANCH_MIN_TOKENS`` with one (GRPO's prompts behind one system prompt, in a later wave)
        or with another prompt of this prefill get that beginning prefilled once, kept, and continue
        from it: later prompts starting with it continue from it too. (A kept prompt holds its
        recurrent states after its last token only; a beginning shared with it, unlike the blocks of
        the prefix cache, must be computed again once.)"""
        if (not self.snapshots.enabled or not self.model.supports_prefix_reuse or self.cfg.supports_prefix_cache
                or any(st.task.input.prompt_images for st in states)):
            return
        keys = {id(st): self._share_key(st.task) for st in states}
        tokens = {id(st): np.asarray(st.task.input.prompt, dtype=np.int64) for st in states}
        # Prompts (kept ones and this prefill's) by weights and first BRANCH_MIN_TOKENS tokens: only
        # those that agree on these can share enough.
        lead: dict[tuple, list[np.ndarray]] = {}
        kept = [(w, np.frombuffer(t, dtype=np.int64)) for w, logits, t, images in list(self.snapshots.entries)
                if not logits and not images]
        for w, t in kept + [(keys[id(st)][0], tokens[id(st)]) for st in states if keys[id(st)] is not None]:
            if len(t) >= BRANCH_MIN_TOKENS:
                lead.setdefault((w, t[:BRANCH_MIN_TOKENS].tobytes()), []).append(t)
        branches: dict[tuple, list[_TaskState]] = {}
        for st in states:
            key, mine = keys[id(st)], tokens[id(st)]
            if st.head is not None or key is None or _needs_prompt_logits(st.task.input) or len(mine) <= BRANCH_MIN_TOKENS:
                continue
            others = [t for t in lead.get((key[0], mine[:BRANCH_MIN_TOKENS].tobytes()), []) if t is not mine]
            shared = min(max((_common_prefix(mine, t) for t in others), default=0), len(mine) - 1)
            if shared >= BRANCH_MIN_TOKENS:
                branches.setdefault((key[0], False, mine[:shared].tobytes(), ()), []).append(st)
        if not branches:
            return
        firsts = [members[0] for members in branches.values()]
        lens = [len(key[2]) // 8 for key in branches]
        hidden, kv, recurrent = self._forward_whole(firsts, lens, [tokens[id(st)][:n].tolist() for st, n in zip(firsts, lens)])
        last = hidden[torch.arange(len(lens), device=self.device), to_device(lens, self.device) - 1]
        last_logits = self.model.logits(last, _row_segments([st.task.slot for st in firsts], 1))
        self.stats["prefill_tokens"] += sum(lens)
        assert recurrent is not None
        for i, (key, members) in enumerate(branches.items()):
            snap = PromptSnapshot.of(kv, recurrent, i, last_logits[i], lens[i])
            self.snapshots.put(key, snap)
            for st in members:
                st.head = snap
            members[0].computed_head = True

    def _kept_snapshots(self, unique: list[_TaskState]) -> dict[int, PromptSnapshot]:
        """The prompts of ``unique`` whose whole prefill was kept from an earlier admission (never
        those asking prompt logprobs: their hidden states are not kept), ready to seed rows."""
        kept: dict[int, PromptSnapshot] = {}
        if not self.snapshots.enabled:
            return kept
        for u, st in enumerate(unique):
            key = self._share_key(st.task)
            if key is None or _needs_prompt_logits(st.task.input):
                continue
            if not self._keeps_prompts(st.task):
                snap = self._kept_image_prompt(st.task, key, mark=True)
                if snap is not None:
                    kept[u] = snap
                    st.cached_tokens, st.rope_delta = snap.length, snap.rope_delta
                continue
            snap = self._whole_from_tail(st.task, key) if self.prefix.enabled else self.snapshots.get(key)
            if snap is not None:
                kept[u] = snap
                st.cached_tokens = snap.length
        return kept

    def _whole_from_tail(self, task: SampleTask, key: tuple) -> PromptSnapshot | None:
        """A dense model's kept tail of ``task``'s prompt made whole for seeding its rows: every
        position's K/V (the prefix cache's blocks before the tail, then the tail; rows over pages
        hold the blocks' pages instead of a copy, so those are not read) and the kept logits.
        None when nothing is kept or the cache no longer holds every block before the tail."""
        snap = self._kept_tail(task, key)
        if snap is None:
            return None
        self.snapshots.get(key)  # a hit: used most recently
        assert snap.tail is not None
        blocks = self.prefix.lookup(key[0], np.asarray(task.input.prompt).tolist(), snap.start)
        block = self.prefix.block  # a whole last page: a paged cache's rows write it without padding it first
        full = self._prefix_buffer([blocks], [-(-snap.length // block) * block], paged=False)
        full[:, :, 0, :, snap.start:snap.length] = snap.tail
        kv = {layer: (full[j, 0, 0], full[j, 1, 0]) for layer, j in self._kv_index.items()}
        return PromptSnapshot(kv, None, snap.last_logits, snap.length, pages=self.prefix.pages_of(blocks))

    def _kept_tail(self, task: SampleTask, key: tuple) -> PromptSnapshot | None:
        """The tail kept of ``task``'s very prompt (dense models) while the prefix cache still
        holds every block before it; marks nothing used."""
        snap = self.snapshots.peek(key)
        if snap is None:
            return None
        blocks = self.prefix.peek(key[0], np.asarray(task.input.prompt).tolist(), snap.start)
        return snap if len(blocks) * self.prefix.block == snap.start else None

    def _keep_snapshots(self, states: list[_TaskState], out: _Prefilled) -> None:
        """Keep each prompt's prefill result for a later admission of the same prompt: a hybrid
        model's whole states, a dense model's tail past the blocks its prefix cache keeps."""
        if not self.snapshots.enabled:
            return
        tails: list[tuple[tuple, int]] = []  # (key, prompt): dense prompts' tails, taken together
        for i, st in enumerate(states):
            key = self._share_key(st.task)
            if key is None or _needs_prompt_logits(st.task.input):
                continue
            if not self._keeps_prompts(st.task):  # an image prompt: whole, with its rope delta
                self.snapshots.put(key, PromptSnapshot.of(out.kv, out.states, i, out.last_logits[i], out.lens[i],
                                                          st.rope_delta))
                continue
            if out.states is not None:
                self.snapshots.put(key, PromptSnapshot.of(out.kv, out.states, i, out.last_logits[i], out.lens[i]))
            elif out.cacheable[i]:
                tails.append((key, i))
        if tails:
            block = self.prefix.block
            at = [i for _, i in tails]
            snaps = PromptSnapshot.tails_of(out.kv, at, [out.last_logits[i] for i in at],
                                            [out.lens[i] // block * block for i in at], [out.lens[i] for i in at])
            for (key, _), snap in zip(tails, snaps):
                self.snapshots.put(key, snap)

    def _first_tokens(self, states: list[_TaskState], last_logits: list[torch.Tensor]) -> list[_FirstTokens]:
        """Each request's first sampled token, its logprob and top logprobs, for every one of its
        rows (``num_samples``), from its prompt's last logits: drawn for all the requests of a
        prefill at once, so a prefill of many requests reads the device once, not once each.
        A row's draw depends only on its seed, sample index and step, as in :meth:`_decode_step`."""
        ns = [st.task.input.num_samples for st in states]
        rows = [(st, j) for st in states for j in range(st.task.input.num_samples)]
        params = [st.task.input.params for st, _ in rows]
        logits = torch.cat([lg[None].expand(n, -1) for lg, n in zip(last_logits, ns)])
        ints = to_device(np.array([[st.seed for st, _ in rows], [j for _, j in rows], [p.top_k for p in params]],
                                  dtype=np.int64), self.device)
        floats = to_device(np.array([[p.temperature for p in params], [p.top_p for p in params]], dtype=np.float32),
                           self.device)
        u = uniforms(ints[0], ints[1], torch.zeros(len(rows), dtype=torch.long, device=self.device))
        kinds = RowKinds.of([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                            logits.shape[-1], self.device)
        tok, lp, full = choose_tokens(logits, floats[0], ints[2], floats[1], u, kinds)
        tops = _top_logprobs(full, [st.task.input.topk_sample_logprobs for st, _ in rows])
        toks, lps = tok.tolist(), lp.tolist()
        out, a = [], 0
        for n in ns:
            out.append((toks[a:a + n], lps[a:a + n], tops[a:a + n]))
            a += n
        return out

    def _seed_rows(self, requests: list[_TaskState], hidden: torch.Tensor | None, last_logits: torch.Tensor,
                   layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]], length: int, done: list,
                   states: PrefillStates | None = None, prompt: int = 0, shared: object = None,
                   firsts: list[_FirstTokens] | None = None, finished: list[tuple[int, str]] | None = None) -> object:
        """Start the rows of prefilled requests of one prompt (``requests``: GRPO's separate
        requests of it admitted together, or one request): each one's prompt logprobs when asked
        (``hidden``: every prompt position's hidden state), the first token of each sample drawn
        from ``last_logits`` (or given: ``firsts``), and every row's K/V (and recurrent states)
        put into the cache at once, so an admission's eager work on the device is per prompt, not
        per row.

        A paged cache keeps one copy of the prompt's full pages for all the rows of the prompt:
        ``shared`` is what the prefix cache holds of them (None: nothing), and the return value
        what the rows share, held until the caller lets it go. Rows that end at once (a stop
        token first, or one token asked) are retired here, or left in ``finished`` for the caller
        to retire (an admission's, once every prompt's K/V is stored: row indices stay put)."""
        for st in requests:
            if _needs_prompt_logits(st.task.input):
                assert hidden is not None, "prompt logprobs need every prompt position's hidden state"
                self._prompt_logprobs(st, hidden)
        if firsts is None:
            firsts = self._first_tokens(requests, [last_logits] * len(requests))
        group = object()  # the rows of one prompt: admission counts its K/V once
        start = len(self.rows)
        for st in requests:
            for j in range(st.task.input.num_samples):
                row = _Row(st, j, group=group)
                if st.stops.strings:
                    row.watcher = StringStopWatcher(st.stops.strings, self.decode)
                self.rows.append(row)
        rows = range(start, len(self.rows))
        written = self.cache.write_prefix(rows, layer_kv, length, states, prompt, shared)
        if written is not None and len(written) > len(shared or ()):
            # A row may finish at once: the pages stay for the rest (those it was given, the
            # prefix cache's, are held by the caller until now).
            self.cache.hold(written)
            if shared:
                self.cache.let_go(shared)
            shared = written
        samples = [(st, j, first) for st, first in zip(requests, firsts) for j in range(st.task.input.num_samples)]
        ended: list[tuple[int, str]] = []  # rows that end at once
        for r in rows:
            st, j, (toks, lps, tops) = samples[r - start]
            if self._push(self.rows[r], toks[j], lps[j], tops[j]):
                ended.append((r, "stop"))
            elif st.max_tokens <= 1:
                ended.append((r, "length"))
        if finished is None:
            self._retire(ended, done)
        else:
            finished += ended
        return shared

    def _keep_pages(self, task: SampleTask, pages: list[int] | None, layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                    weights: tuple[int | None, int]) -> None:
        """A paged cache's prefix cache adopts the full pages a prompt's first row was written into
        (``layer_kv``: the prompt's K/V, of which it keeps the layers beside the pages)."""
        if self.prefix.pool is None or not self.prefix.enabled or not pages:
            return
        kv = None
        if self.prefix.rowwise:
            n = len(pages) * self.prefix.block
            kv = torch.stack([torch.stack((k[:, :n], v[:, :n])) for _, (k, v) in sorted(layer_kv.items())])
        self.prefix.adopt(weights, np.asarray(task.input.prompt).tolist(), pages, kv)

    def _grow_cache(self, new_rows: int, length: int) -> None:
        """Room in the cache for ``new_rows`` more rows of ``length`` positions beside the running
        rows (each of which needs its prompt, its sampled tokens and the next one)."""
        span = max([length] + [len(r.state.task.input.prompt) + len(r.tokens) for r in self.rows])
        self.cache.ensure(len(self.rows) + new_rows, span)

    # ----------------------------------------------------------------------------- preemption
    def _make_room(self) -> None:
        """Before a decode step: while the rows would outgrow the K/V budget in it, preempt the
        newest request of the key holding the most rows (the oldest request is never preempted:
        it always fits alone, admission checked it at its longest)."""
        if not self.kv_cache_bytes:
            return
        while True:
            # each row after a burst (see _decode_step), and room for the rows of the prompt being chunked
            positions = [len(r.state.task.input.prompt) + len(r.tokens) + self.decode_burst - 1 for r in self.rows]
            chunked: list[RowNeed] = []
            if self._chunked is not None:
                inp = self._chunked.state.task.input
                chunked = [RowNeed(self._held(inp, 0), id(self._chunked.state), len(inp.prompt))] * inp.num_samples
            # Far from the budget (nearly always) the positions alone say so; the exact count, a
            # tally over every row's pages, costs about as much as a burst's other host work.
            if self.cache.bytes_at_most(positions + [n.positions for n in chunked]) <= self.kv_cache_bytes:
                return
            needs = [self._need(i, p) for i, p in enumerate(positions)] + chunked
            if self.cache.bytes_for(needs) <= self.kv_cache_bytes:
                return
            waiting = {id(st) for st in self._resume}
            live = [st for st in self._live_states() if id(st) not in waiting and not st.task.input.prompt_images]
            if len(live) < 2 and not (self._chunked and self.rows):
                return
            self._preempt(self._preemption_victim(live))

    @staticmethod
    def _preemption_victim(live: list[_TaskState]) -> _TaskState:
        """The request to preempt: the newest of the key that holds the most rows, so a key's
        request admitted in its turn (:meth:`_order_inbox`) is not the first to give its rows
        back. Never the oldest request while another could go."""
        held = _rows_by_owner(live)
        oldest = min(live, key=lambda st: st.order)
        candidates = [st for st in live if st is not oldest] or live
        return max(candidates, key=lambda st: (held[st.task.owner], st.order))

    def _preempt(self, st: _TaskState, count: int | None = None) -> None:
        """Take ``st``'s rows (or its ``count`` last ones) off the batch (their K/V freed) and queue
        it to resume first: each row keeps its sampled tokens, so recomputing its K/V and decoding
        on gives what it would have (a row's draws depend only on its seed, sample index and
        step), up to float rounding of the recomputed K/V. A prompt being chunked goes back to the
        head of the queue whole."""
        self.stats["preempted"] += 1
        st.yielded = False
        if self._chunked is not None and self._chunked.state is st:
            self._chunked = None
            self.inbox.appendleft(st.task)
            return
        mine = sorted((r for r, row in enumerate(self.rows) if row.state is st), key=lambda r: self.rows[r].sample_idx)
        if count is not None:
            mine = mine[len(mine) - count:]
        st.paused += [self.rows[r] for r in mine]
        self._drop_rows(mine)
        st.paused.sort(key=lambda row: row.sample_idx)
        if any(x is st for x in self._resume):
            return
        i = 0
        while i < len(self._resume) and self._resume[i].order < st.order:
            i += 1
        self._resume.insert(i, st)

    def _resume_rows(self, st: _TaskState, done: list) -> None:
        """Bring a preempted request's rows back: prefill each one's prompt and sampled tokens but
        the last (its next input, as in the cache before) and put them back in the batch."""
        rows, st.paused = st.paused, []
        prompt = np.asarray(st.task.input.prompt).tolist()
        prompts = [prompt + row.tokens[:-1] for row in rows]
        lens = [len(p) for p in prompts]
        try:
            _, kv, recurrent = self._forward_whole([st] * len(rows), lens, prompts)
            self._grow_cache(len(rows), max(lens) + 1)
        except self.fatal_errors:
            raise
        except Exception as exc:  # e.g. out of memory: fail this request, keep the running ones
            log.exception("resuming a preempted request failed")
            self._fail([st], exc, done)
            return
        self.stats["recomputed_tokens"] += sum(lens)
        with self.cache.writes_together():  # every row's K/V stored together (a paged cache)
            for i, row in enumerate(rows):
                row.group = None  # recomputed alone: it shares nothing
                r = len(self.rows)
                self.rows.append(row)
                self.cache.write_prefix(range(r, r + 1), {layer: (k[i], v[i]) for layer, (k, v) in kv.items()},
                                        lens[i], recurrent, i)
        self._rows_changed()

    # ----------------------------------------------------------------------------- chunked prefill
    def _prefilled_in_chunks(self, task: SampleTask) -> bool:
        """Whether ``task``'s prompt is prefilled a chunk per step: it is longer than a chunk, and
        its later chunks can run over the earlier ones' K/V and states (not image prompts)."""
        inp = task.input
        return self._can_chunk and len(inp.prompt) > self.prefill_chunk_tokens and not inp.prompt_images

    def _kept_head(self, task: SampleTask) -> PromptSnapshot | None:
        """On hybrid models, the longest kept prompt ``task``'s prompt equals or extends; on dense
        ones, the kept tail of this very prompt; for an image prompt, its own kept whole prefill
        (see :mod:`tinsmith.sampling.prompt_states`). None when there is none or it cannot be used
        (prompt logprobs asked, chunks off)."""
        key = self._share_key(task)
        if not self._keeps_prompts(task):
            return self._kept_image_prompt(task, key, mark=False)
        if (not self.snapshots.enabled or key is None or not self.model.supports_prefix_reuse
                or _needs_prompt_logits(task.input)):
            return None
        if self.prefix.enabled:
            return self._kept_tail(task, key)
        return self.snapshots.longest_prefix(key[0], key[2])

    def _start_chunked(self, st: _TaskState, done: list, head: PromptSnapshot | None = None) -> None:
        """Make ``st`` the prompt prefilled in chunks: its K/V buffer, with the cached blocks of its
        prefix already in place (prompts that ask for prompt logprobs read none, as whole ones),
        or on hybrid models continuing from ``head``, a kept prompt it extends (its K/V and
        recurrent states)."""
        inp = st.task.input
        prompt = np.asarray(inp.prompt).tolist()
        weights = self._weights_of(st.task.slot)
        try:
            blocks = [] if _needs_prompt_logits(inp) or head is not None else \
                self.prefix.lookup(weights, prompt, len(prompt))
            kv = self._prefix_buffer([blocks], [len(prompt)])
            if head is not None:
                for layer, (k, v) in head.kv.items():
                    kv[self._kv_index[layer], 0, 0, :, : head.length] = k
                    kv[self._kv_index[layer], 1, 0, :, : head.length] = v
        except self.fatal_errors:
            raise
        except Exception as exc:  # e.g. out of memory for the buffer: this request fails alone
            log.exception("could not start the chunked prefill of a %d-token prompt", len(prompt))
            self._fail([st], exc, done)
            return
        # At least the last prompt token is computed: its logits give the first sample.
        st.cached_tokens = head.length if head is not None else min(len(blocks) * self.prefix.block, len(prompt) - 1)
        self._chunked = _ChunkedPrefill(st, prompt, weights, kv, st.cached_tokens,
                                        None if head is None else head.states)

    def _prefill_next_chunk(self, done: list) -> None:
        """Prefill the next chunk of the long prompt; after its last chunk its rows join the batch."""
        c = self._chunked
        assert c is not None
        st, P = c.state, len(c.prompt)
        start, end = c.done, min(len(c.prompt), c.done + self.prefill_chunk_tokens)
        try:
            hidden, kv, c.recurrent = self._forward_over_prefix([st], [c.prompt], [end], [start], c.kv[..., :end, :],
                                                                c.recurrent)
            self.stats["prefill_chunks"] += 1
            self.stats["prefill_tokens"] += end - start
            c.done = end
            if _needs_prompt_logits(st.task.input):
                c.hidden.append(hidden[0, : end - start])
            self._cache_chunk_blocks(c)
            if end < P:
                return
            self._chunked = None
            segments = _row_segments([st.task.slot], 1)
            last_logits = self.model.logits(hidden[0, end - start - 1 : end - start], segments)[0]
            self.stats["prefills"] += 1
            self.stats["cached_prompt_tokens"] += st.cached_tokens
            self._grow_cache(st.task.input.num_samples, P + 1)
            layer_kv = {layer: (c.kv[self._kv_index[layer], 0, 0], c.kv[self._kv_index[layer], 1, 0]) for layer in kv}
            prompt_hidden = torch.cat(c.hidden) if c.hidden else hidden[0, :0]
            self._keep_chunked(c, last_logits)
            pages = self._seed_rows([st], prompt_hidden, last_logits, layer_kv, P, done, c.recurrent)
            if pages:
                if c.weights is not None:
                    self._keep_pages(st.task, pages, layer_kv, c.weights)
                self.cache.let_go(pages)
            self._rows_changed()
        except self.fatal_errors:
            raise
        except Exception as exc:  # e.g. out of memory: fail this request, keep the running ones
            log.exception("chunked prefill of a %d-token prompt failed", P)
            self._fail([st], exc, done)

    def _keep_chunked(self, c: _ChunkedPrefill, last_logits: torch.Tensor) -> None:
        """Keep a prompt prefilled in chunks (or continued from a kept one) for later admissions
        of it (or, on hybrid models, of prompts extending it), unless the weights changed meanwhile."""
        key = self._share_key(c.state.task)
        if (not self.snapshots.enabled or key is None or key[0] != c.started
                or _needs_prompt_logits(c.state.task.input) or not self._keeps_prompts(c.state.task)):
            return
        kv = {layer: (c.kv[i, 0], c.kv[i, 1]) for layer, i in self._kv_index.items()}
        if c.recurrent is not None:
            self.snapshots.put(key, PromptSnapshot.of(kv, c.recurrent, 0, last_logits, len(c.prompt)))
        elif c.weights is not None:  # its blocks are cached under the same weights
            start = len(c.prompt) // self.prefix.block * self.prefix.block
            self.snapshots.put(key, PromptSnapshot.tail_of(kv, 0, last_logits, start, len(c.prompt)))

    def _cache_chunk_blocks(self, c: _ChunkedPrefill) -> None:
        """Keep the full blocks prefilled so far in the prefix cache, unless the weights changed
        since the first chunk (its K/V would then mix two versions)."""
        if c.weights is None or not self.prefix.enabled:
            return
        if self._weights_of(c.state.task.slot) != c.weights:
            c.weights = None
            return
        hi = c.done // self.prefix.block * self.prefix.block
        if hi and self.prefix.pool is None:  # a paged cache's prefix cache adopts the rows' pages once written
            self.prefix.insert(c.weights, c.prompt[:hi], c.kv[:, :, 0, :, :hi])

    def _weights_of(self, slot: int | None) -> tuple[int | None, int]:
        """What computed a prompt's K/V: the adapter slot and its weights' current version."""
        return slot, self.model.weights_version(slot)

    def _share_key(self, task: SampleTask) -> tuple | None:
        """Requests with equal keys in one admission share a prefill; None: this one never shares.
        ``(weights, prompt logprobs asked, prompt tokens, images)``: an image prompt's K/V depend
        on its images too, so they are in its key, each with its place (``()`` for text).

        Nothing shares when the prefix cache is off (``prefix_cache_bytes=0``: every request
        prefilled on its own). What is kept past an admission under these keys: text prompts'
        states and tails, image prompts' whole prefills (:meth:`_keeps_prompts`)."""
        inp = task.input
        if not self.share_prompts:
            return None
        images = tuple((im.position, im.data) for im in inp.prompt_images)
        return (self._weights_of(task.slot), _needs_prompt_logits(inp), np.asarray(inp.prompt).tobytes(), images)

    @staticmethod
    def _keeps_prompts(task: SampleTask) -> bool:
        """Whether ``task``'s prompt takes part in what is kept by tokens past an admission (prefix
        blocks, dense models' tails, prompts that extend a kept one): not an image prompt, whose
        positions follow its images' grids. An image prompt is kept whole instead, and reused
        only by an equal one (same tokens, same images at the same places):
        :meth:`_kept_image_prompt`."""
        return not task.input.prompt_images

    def _kept_image_prompt(self, task: SampleTask, key: tuple | None, mark: bool) -> PromptSnapshot | None:
        """The whole prefill kept of ``task``'s very image prompt, if any (``mark``: as used)."""
        if key is None or not self.snapshots.enabled or _needs_prompt_logits(task.input):
            return None
        return self.snapshots.get(key) if mark else self.snapshots.peek(key)

    def _forward_prompts(self, states: list[_TaskState]) -> _Prefilled:
        """One forward pass over the prompts of ``states`` (sorted by slot), reading and filling
        the prefix cache; see :class:`_Prefilled`."""
        lens = [len(s.task.input.prompt) for s in states]
        prompts = [np.asarray(s.task.input.prompt).tolist() for s in states]
        weights = [self._weights_of(s.task.slot) for s in states]
        images = [s.task.input.prompt_images for s in states]
        cacheable = [not im for im in images]
        blocks: list[list] = [[] for _ in states]
        if not any(images):  # reading needs plain positions for every row of the batch
            for i, st in enumerate(states):
                if not _needs_prompt_logits(st.task.input):
                    blocks[i] = self.prefix.lookup(weights[i], prompts[i], lens[i])
        # At least the last prompt token is computed: its logits give the first sample. Where the
        # cache holds it too, its K/V are the cached ones (a paged cache's rows hold that page).
        starts = [min(len(bl) * self.prefix.block, n - 1) for bl, n in zip(blocks, lens)]
        if any(images):  # image positions follow the image grid: every prompt of the prefill is computed whole
            for st in states:
                st.head, st.computed_head = None, False
        heads = [st.head for st in states]  # hybrid models (which keep no blocks): kept prompts they continue
        if any(h is not None for h in heads):
            starts = [0 if h is None else h.length for h in heads]
        for st, c in zip(states, starts):
            st.cached_tokens = 0 if st.computed_head else c
        recurrent = None
        if any(starts):
            full = self._prefix_buffer(blocks, [c + max(n - c for n, c in zip(lens, starts)) for c in starts])
            after = None
            if any(h is not None for h in heads):  # each prompt from its kept one's K/V and states (or from nothing)
                for i, h in enumerate(heads):
                    for layer, (k, v) in (h.kv.items() if h is not None else ()):
                        full[self._kv_index[layer], 0, i, :, : h.length] = k
                        full[self._kv_index[layer], 1, i, :, : h.length] = v
                after = PrefillStates.stacked([None if h is None else h.states for h in heads])
            hidden, kv, recurrent = self._forward_over_prefix(states, prompts, lens, starts, full, after)
        else:
            hidden, kv, recurrent = self._forward_whole(states, lens)
        b = len(states)
        ends = to_device([n - c - 1 for n, c in zip(lens, starts)], self.device)
        last = hidden[torch.arange(b, device=self.device), ends]
        last_logits = self.model.logits(last, _row_segments([s.task.slot for s in states], 1))
        for i in range(b):
            done_blocks = len(blocks[i])
            if (cacheable[i] and self.prefix.enabled and self.prefix.pool is None
                    and lens[i] // self.prefix.block > done_blocks):
                lo, hi = starts[i], lens[i] // self.prefix.block * self.prefix.block
                layer_kv = torch.stack([torch.stack((kv[l][0][i, :, lo:hi], kv[l][1][i, :, lo:hi])) for l in sorted(kv)])
                self.prefix.insert(weights[i], prompts[i][:hi], layer_kv, lo)
        pages = [self.prefix.pages_of(bl) for bl in blocks]
        return _Prefilled(hidden, kv, last_logits, lens, starts, recurrent, pages, weights, cacheable)

    def _forward_whole(self, states: list[_TaskState], lens: list[int], prompts: list[list[int]] | None = None):
        """Prefill whole prompts (right-padded): hidden states ``(b, L, h)``, each attention layer's
        K/V, and on hybrid models each prompt's recurrent states. ``prompts``: the tokens to run
        when they are not the requests' prompts (a preempted row: its prompt and sampled tokens)."""
        b, L = len(states), max(lens)
        toks = np.zeros((b, L), dtype=np.int64)
        for i, s in enumerate(states):
            toks[i, : lens[i]] = s.task.input.prompt if prompts is None else prompts[i]
        tokens = to_device(toks, self.device)
        positions = torch.arange(L, device=self.device).expand(b, L)
        visual = None
        images = [s.task.input.prompt_images for s in states]
        if any(images):
            assert self.vision is not None
            positions, visual, deltas = self.vision.batch_inputs(tokens, lens, images)
            for st, delta in zip(states, deltas):
                st.rope_delta = delta
        segments = _row_segments([s.task.slot for s in states], L)
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        recurrent = self.cache.prefill_states(to_device(lens, self.device), L)
        hidden = self.model.hidden_states(tokens, positions, segments, attend=recording_attention(kv, recurrent),
                                          visual=visual)
        return hidden, kv, recurrent

    def _prefix_buffer(self, blocks: list[list], widths: list[int], paged: bool = True) -> torch.Tensor:
        """``(attention layers, 2, b, kv_heads, max(widths), head_dim)``: each row's cached prefix blocks
        first, zeros after (where :meth:`_forward_over_prefix` writes the positions it computes).
        ``paged=False``: the blocks' pool pages are not read (rows that hold the pages never read them)."""
        cfg = self.cfg
        full = torch.zeros((len(self._kv_index), 2, len(blocks), cfg.num_kv_heads, max(widths), cfg.head_dim),
                           device=self.device, dtype=self.dtype)
        for i, bl in enumerate(blocks):
            self.prefix.read_into(full[:, :, i], bl, paged)
        return full

    def _forward_over_prefix(self, states, prompts, lens, starts, full: torch.Tensor,
                             after: PrefillStates | None = None):
        """Prefill only each prompt's positions ``starts[i]:lens[i]``, over the K/V before them.

        ``full`` ``(attention layers, 2, b, kv_heads, width, head_dim)`` holds each row's K/V of positions
        before ``starts[i]`` (cached prefix blocks, or the earlier chunks of a long prompt); the
        computed K/V are written into it at their positions (``width >= lens[i]``), so each
        layer's K/V come back laid out by position, as a whole prefill gives them. Row ``i``'s
        tokens run at their true positions and attend to the K/V before them and causally to
        themselves. Hybrid models continue from the recurrent states ``after`` (those of the
        prefill of the positions before; only one prompt is ever prefilled so, a long one in
        chunks) and return their new states too.
        """
        b = len(states)
        S = max(n - c for n, c in zip(lens, starts))
        width = full.shape[4]
        toks = np.zeros((b, S), dtype=np.int64)
        for i in range(b):
            toks[i, : lens[i] - starts[i]] = prompts[i][starts[i]: lens[i]]
        tokens = to_device(toks, self.device)
        start = to_device(starts, self.device)
        positions = start[:, None] + torch.arange(S, device=self.device)[None, :]  # (b, S)
        cfg = self.cfg
        keys = torch.arange(width, device=self.device)[None, None, :]  # (1, 1, width)
        before = keys <= positions[:, :, None]  # (b, S, width): causal by position
        masks: dict[int | None, torch.Tensor] = {None: before}
        where = positions[:, None, :, None].expand(b, cfg.num_kv_heads, S, cfg.head_dim)
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
            K, V = full[self._kv_index[layer], 0], full[self._kv_index[layer], 1]
            K.scatter_(2, where, k)  # padding positions land after each row's prompt: never seen by its tokens
            V.scatter_(2, where, v)
            kv[layer] = (K, V)
            if window not in masks:
                masks[window] = before & (keys > positions[:, :, None] - window)
            return masked_attention(q, K, V, masks[window], sinks)

        new = to_device([n - c for n, c in zip(lens, starts)], self.device)
        recurrent = self.cache.prefill_states(new, S, after)
        attend.recurrent = recurrent  # type: ignore[attr-defined]
        segments = _row_segments([s.task.slot for s in states], S)
        hidden = self.model.hidden_states(tokens, positions, segments, attend=attend)
        return hidden, kv, recurrent

    def _prompt_logprobs(self, st: _TaskState, h: torch.Tensor) -> None:
        inp = st.task.input
        P = h.shape[0]
        slot = st.task.slot
        lp = torch.log_softmax(self.model.logits(h, None if slot is None else [(slot, 0, P)]), dim=-1)
        prompt = torch.as_tensor(inp.prompt, device=self.device)
        first = 1 if inp.prompt_logprobs_last_n is None else max(1, P - inp.prompt_logprobs_last_n)
        out = np.full(P, np.nan, dtype=np.float32)
        if P > 1:
            vals = lp[:-1].gather(-1, prompt[1:, None])[:, 0].float().cpu().numpy()
            out[first:] = vals[first - 1 :]
        st.prompt_logprobs = out if inp.prompt_logprobs else None
        k = inp.topk_prompt_logprobs
        if k:
            ids = np.zeros((P, k), dtype=np.int32)
            vals_k = np.full((P, k), TOPK_SENTINEL, dtype=np.float32)
            if P > 1:
                kk = min(k, lp.shape[-1])
                top = torch.topk(lp[:-1], kk, dim=-1)
                ids[first:, :kk] = top.indices[first - 1 :].cpu().numpy()
                vals_k[first:, :kk] = top.values[first - 1 :].float().cpu().numpy()
            st.topk_ids, st.topk_lps = ids, vals_k
        if inp.target_prompt_ids is not None:
            asked = torch.as_tensor(inp.target_prompt_ids, device=self.device)
            got = lp[:-1].gather(-1, asked.clamp(min=0))
            st.target_lps = torch.where(asked >= 0, got, torch.zeros_like(got)).float().cpu().numpy()
        if inp.prompt_alt_tokens_k:
            st.alt_tokens, st.alt_lps = self._prompt_alt_tokens(st, lp[:-1])

    def _prompt_alt_tokens(self, st: _TaskState, lp: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """``k`` independent draws at the request's temperature from each next-token distribution.

        Row ``i`` draws from the distribution after prompt position ``i`` (alternatives to
        token ``i + 1``). The draws use the request's seed on a stream of their own (the
        sampled sequences' streams are untouched), and the logprobs are the model's own.
        """
        inp = st.task.input
        k, rows = inp.prompt_alt_tokens_k, lp.shape[0]
        dev = lp.device
        pos = torch.arange(rows, device=dev)[:, None].expand(rows, k).reshape(-1)  # the stream's step = position
        draw = torch.arange(k, device=dev).repeat(rows)  # the stream's sample index = draw number
        seeds = torch.full((rows * k,), fold_seed(st.seed ^ _ALT_STREAM), dtype=torch.long, device=dev)
        u = uniforms(seeds, draw, pos).view(rows, k)
        tok = draw_per_row(lp.float(), inp.params.temperature, u)
        return tok.cpu().numpy().astype(np.int64), lp.gather(-1, tok).float().cpu().numpy()

    # ----------------------------------------------------------------------------- decoding
    def _decode_step(self, done: list) -> None:
        """Decode bursts of steps for every row, reading each burst's tokens back once.

        The host needs the sampled tokens only to check stop conditions and to record results,
        so a burst of ``k`` steps runs back to back on the device (each step's tokens feed the
        next without leaving it) and pays one read-back instead of ``k``: on a GPU the launch
        queue never drains waiting for the host. A row that stops inside a burst has decoded a
        few tokens past its stop into its own cache; they are dropped, and no other row sees
        them. ``k`` never takes a row past its ``max_tokens``. Tokens are identical whatever
        ``k`` is: a row's draws depend only on its seed, sample index and step.

        Running ahead (``run_ahead``): while nothing but decoding is left to do (see
        :meth:`_may_run_ahead`), the next burst is queued *before* the last one's tokens are read
        and recorded, so the device decodes while the host records: the host's work per burst
        (per row, and on a GPU about as long as a decode step's idle gaps) leaves the device's
        timeline. The next burst needs nothing from the host: its input tokens are the last
        burst's, still on the device. When rows end inside a burst, the burst queued after it has
        decoded past their ends too: those tokens are dropped (as a stop inside a burst drops its
        row's later tokens), and the rows leave at once, behind the queued burst on the device:
        the cache's rows move, and the batch's per-row tensors are gathered from the queued
        burst's own outputs (:meth:`_DecodeBatch.kept`), so the next burst can be queued before
        that one is read.
        """
        burst = self._launch_burst(0)
        while True:
            ahead = self._launch_burst(burst.k) if self._may_run_ahead(burst) else None
            if ahead is not None:
                self.stats["bursts_ahead"] += 1
            finished = self._take_burst(burst)
            if ahead is not None and finished:
                self.stats["rows_left_ahead"] += len(finished)
            self._retire(finished, done, pending=0 if ahead is None else ahead.k)
            if ahead is None:
                return
            burst = ahead

    def _launch_burst(self, pending: int) -> _Burst:
        """Queue a burst for every row, ``pending`` tokens after those recorded (the tokens of a
        burst launched and not yet read); its outputs start for the host behind it."""
        n = len(self.rows)
        batch = self._batch()
        # As many steps as the rows still decoding allow; rows whose last token is in the burst
        # queued before this one (pending) ride along, their tokens past the end dropped.
        left = [row.state.max_tokens - len(row.tokens) - pending for row in self.rows]
        k = max(1, min([self.decode_burst] + [t for t in left if t > 0]))
        # Each row's positions after this burst: a row's cache holds its prompt and every sampled
        # token but the last, so this is known on the host (no read-back per step).
        spans = [len(row.state.task.input.prompt) + len(row.tokens) + pending + k - 1 for row in self.rows]
        span = max(spans)
        asks = [row.state.task.input.topk_sample_logprobs for row in self.rows]
        if self._static_decode(spans):
            assert self.graphs is not None
            self._grow(lambda: self.cache.reserve(spans))
            tokens, logprobs, best = self.graphs.burst(batch, [row.state.task.slot for row in self.rows], n, k,
                                                       min(max(asks), self.cfg.vocab_size))
            tops = _asking_rows(best, asks) if best else [None] * k
        else:
            self._grow(lambda: (self.cache.ensure(n, span), self.cache.reserve(spans)))
            tokens, logprobs, tops = self._eager_burst(batch, n, k, span, asks)
        self.stats["decode_steps"] += k
        self.stats["sampled_tokens"] += n * k
        asking, outputs = None, [tokens, logprobs]
        if tops and tops[0] is not None:
            asking = tops[0][0]
            outputs += [torch.stack([found.indices for _, found in tops]), torch.stack([found.values for _, found in tops])]
        return _Burst(list(self.rows), k, asks, asking, HostCopies(outputs))

    def _take_burst(self, burst: _Burst) -> list[tuple[int, str]]:
        """Read a burst's tokens back (its one read) and record them for each of its rows still
        in the batch (a row that ended in an earlier burst has left; its tokens here are past its
        end); the rows it ended, by their place in the batch now, with why."""
        self.stats["decode_reads"] += 1
        host = burst.out.lists()
        tok_host, lp_host = host[0], host[1]
        top_host = _tops_by_step(burst.asking, host[2], host[3], burst.asks) if burst.asking else None
        place = {id(row): r for r, row in enumerate(self.rows)}
        finished: list[tuple[int, str]] = []
        for i, row in enumerate(burst.rows):
            r = place.get(id(row))
            if r is None:
                continue
            tops_r = [top_host[step][i] for step in range(burst.k)] if top_host and burst.asks[i] else None
            reason = self._push_burst(row, tok_host[i], lp_host[i], tops_r)
            if reason is not None:
                finished.append((r, reason))
        return finished

    def _may_run_ahead(self, burst: _Burst) -> bool:
        """Whether to queue the next burst before reading ``burst``: only when the scheduler would
        do nothing but decode in between (nothing waits to be admitted or resumed, no long prompt
        is being prefilled, nothing was cancelled, the time slice is not spent), some row has tokens
        left after ``burst``, and the K/V budget holds the rows after both bursts without
        preempting (rows ending by their length in ``burst`` decode up to a burst past it)."""
        if not self.run_ahead or not self.rows or self.inbox or self._resume or self._chunked is not None:
            return False
        if time.perf_counter() >= self._deadline or (self._arrivals is not None and self._arrivals()):
            return False
        board = self.cancellations
        if board is not None and board.version != self._cancel_version:
            return False
        ending = [r.state.max_tokens - len(r.tokens) <= burst.k for r in self.rows]
        if all(ending):
            return False  # every row ends by its length in this burst: nothing to queue
        # Each row's positions after the next burst, at the most.
        positions = [len(r.state.task.input.prompt) + len(r.tokens) + burst.k + self.decode_burst - 1
                     for r in self.rows]
        if any(ending):  # rows riding along past their end must not grow the cache past the longest row
            longest = max(self._longest(r.state.task.input) for r in self.rows)
            if any(p > longest for p, end in zip(positions, ending) if end):
                return False
        if self.kv_cache_bytes and self.cache.bytes_at_most(positions) > self.kv_cache_bytes:
            return False  # near the budget: the next call's _make_room decides
        return True

    def _eager_burst(self, batch: _DecodeBatch, n: int, k: int, span: int, asks: list[int]):
        """``k`` decode steps over the live rows only, shapes cut to them: (n, k) tokens and
        logprobs, and each step's device top-k logprobs for the rows that ask."""
        toks, lps, tops = [], [], []
        for i in range(k):
            positions = self.cache.lengths[:n][:, None]
            if batch.rope_deltas is not None:
                positions = positions + batch.rope_deltas[:, None]
            hidden = self.model.hidden_states(batch.last[:, None], positions, batch.groups,
                                              attend=self.cache.decode_attention(n, span - (k - 1 - i)),
                                              within_context=True)  # _validate holds every row to the context
            logits = self.model.logits(hidden[:, 0], batch.groups, fp32=False)  # the token choice widens them
            self.cache.lengths[:n] += 1
            u = KeyedUniforms(batch.keys, batch.steps)
            tok, lp, full = choose_tokens(logits, batch.temperature, batch.top_k, batch.top_p, u, batch.kinds,
                                          need_full=any(k > 0 for k in asks))
            batch.last, batch.steps = tok, batch.steps + 1
            toks.append(tok)
            lps.append(lp)
            tops.append(_device_top_logprobs(full, asks))
        return torch.stack(toks, 1), torch.stack(lps, 1), tops

    def _static_decode(self, spans: list[int]) -> bool:
        """Whether a burst of rows reaching ``spans`` positions takes the static step
        (:mod:`tinsmith.sampling.decode_graphs`); when it does, the cache is sized for it: the
        bucket's rows, and room for the burst.

        The capacity grows to at least twice its size (up to the longest any row may reach), so
        a batch sees a few spans, each a graph of its own, rather than one per cache block.
        """
        if self.graphs is None:
            return False
        n, span = len(spans), max(spans)
        why = self.graphs.refusal(n)
        rows, capacity = bucket_for(n) or n, self.cache.capacity
        if span > capacity:
            longest = max(self._longest(row.state.task.input) for row in self.rows)
            capacity = max(span, min(longest, 2 * capacity))
        if (why is None and self.kv_cache_bytes  # counted only under a budget, exactly only when near it
                and self.cache.static_bytes_at_most(spans, rows, capacity) > self.kv_cache_bytes):
            needs = [self._need(i, positions) for i, positions in enumerate(spans)]
            if self.cache.static_bytes(needs, rows, capacity) > self.kv_cache_bytes:
                why = "the bucket's padding rows would pass the K/V cache budget"
        if why is not None:
            if why not in self._eager_reasons:  # each reason once (a failed capture logged its own warning)
                self._eager_reasons.add(why)
                log.info("decoding eagerly (no CUDA graph): %s", why)
            return False
        self._grow(lambda: self.cache.ensure(rows, capacity))
        return True

    def _grow(self, grow: Callable[[], None]) -> None:
        """Run ``grow`` (the cache growing for a decode burst). Out of device memory, the prefix cache's
        blocks, then what other idle samplers keep, are given up, and it runs once more: growing
        stops where it failed and goes on from there, so the cache is whole either way."""
        try:
            grow()
        except torch.OutOfMemoryError:
            if not self._give_memory_up("growing the K/V cache"):
                raise
            grow()

    def _give_memory_up(self, where: str) -> bool:
        """Out of device memory ``where``: drop the prefix cache and have other idle samplers give
        back what they keep; whether anything was given up (worth trying once more)."""
        kept = self.prefix.bytes + self.snapshots.bytes
        self.prefix.clear()
        self.snapshots.clear()
        released = self.release_elsewhere() if self.release_elsewhere is not None else 0
        if not (kept or released):
            return False
        log.warning("out of memory %s: dropped the prefix cache (%d bytes), other idle samplers gave back %d bytes; "
                    "trying again", where, kept, released)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def _push_burst(self, row: _Row, tokens: list[int], logprobs: list[float], tops: list | None) -> str | None:
        """Record a burst's tokens of one row up to the first that ends it; why it ended ("stop",
        "length") or None. Rows without stop strings take the burst by slices (the host's work
        per burst, which the device waits for, is per row rather than per token)."""
        if row.watcher is not None:
            for i, token in enumerate(tokens):
                if self._push(row, token, logprobs[i], None if tops is None else tops[i]):
                    return "stop"
                if len(row.tokens) >= row.state.max_tokens:
                    return "length"
            return None
        stops = row.state.stops.token_ids
        n = min(len(tokens), row.state.max_tokens - len(row.tokens))
        cut = next((i + 1 for i in range(n) if tokens[i] in stops), None) if stops else None
        n = n if cut is None else cut
        row.tokens.extend(tokens[:n])
        row.logprobs.extend(logprobs[:n])
        if tops is not None:
            row.topk.extend(top for top in tops[:n] if top is not None)
        if cut is not None:
            return "stop"
        return "length" if len(row.tokens) >= row.state.max_tokens else None

    def _push(self, row: _Row, token: int, logprob: float, top: tuple[list[int], list[float]] | None) -> bool:
        """Record a sampled token (and its row's top-k logprobs when asked); True if it ends the
        sequence by a stop condition."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if top is not None:
            row.topk.append(top)
        if token in row.state.stops.token_ids:
            return True
        return row.watcher is not None and row.watcher.push(token)

    def _retire(self, finished: list[tuple[int, str]], done: list, pending: int = 0) -> None:
        """Move finished rows (``(row, why it ended)``) out of the batch, recording each one's
        sequence (and its request's result once its last row is done). ``pending``: the steps
        of a burst queued and not yet read (see :meth:`_drop_rows`)."""
        if not finished:
            return
        for r, reason in finished:
            self._record(self.rows[r], reason, done)
        self._drop_rows([r for r, _ in finished], pending)

    def _record(self, row: _Row, reason: str, done: list) -> None:
        """Put a finished row's sequence into its request; the request's result once its last row is done."""
        st = row.state
        seq = SampledSequence(
            tokens=np.asarray(row.tokens, dtype=np.int32),
            logprobs=np.asarray(row.logprobs, dtype=np.float32),
            stop_reason=reason,  # type: ignore[arg-type]
        )
        k = st.task.input.topk_sample_logprobs
        if k:
            ids = np.zeros((len(row.tokens), k), dtype=np.int32)
            vals = np.full((len(row.tokens), k), TOPK_SENTINEL, dtype=np.float32)
            for t, (ii, vv) in enumerate(row.topk):
                ids[t, : len(ii)] = ii
                vals[t, : len(vv)] = vv
            seq.topk_token_ids, seq.topk_logprobs = ids, vals
        st.sequences[row.sample_idx] = seq
        st.remaining -= 1
        if st.remaining == 0:
            done.append((st.task.key, SampleResult(
                sequences=list(st.sequences),  # type: ignore[arg-type]
                prompt_logprobs=st.prompt_logprobs,
                topk_prompt_token_ids=st.topk_ids,
                topk_prompt_logprobs=st.topk_lps,
                target_prompt_logprobs=st.target_lps,
                target_prompt_csr=st.task.input.target_prompt_csr,
                prompt_alt_tokens=st.alt_tokens,
                prompt_alt_logprobs=st.alt_lps,
                prompt_cache_hit_tokens=st.cached_tokens,
            )))

    def _drop_rows(self, leaving: list[int], pending: int = 0) -> None:
        """Remove rows ``leaving``: the last rows move into their places, highest place first (rows
        stay dense), and the cache follows in one step for all of them.

        ``pending``: steps of a burst queued and not yet read. The rows' caches hold that many
        positions more than the host has tokens for, and the burst's outputs (each row's last
        token and step count) exist on the device only: the batch's tensors are then gathered
        there, behind the burst, rather than made again from the host's tokens."""
        if not leaving:
            return
        order = list(range(len(self.rows)))  # place -> the row that ends up there
        for r in sorted(set(leaving), reverse=True):
            order[r] = order[-1]
            order.pop()
        # Each moving row holds its prompt and every sampled token but the last (see _decode_step).
        upto = max((len(self.rows[src].state.task.input.prompt) + len(self.rows[src].tokens) + pending
                    for dst, src in enumerate(order) if dst != src), default=0)
        self.cache.keep_rows(len(self.rows), order, upto)
        self.rows = [self.rows[src] for src in order]
        kept = self._decode_batch if pending and self._decode_batch is not None and self.rows else None
        self._rows_changed()
        if kept is not None:
            self._decode_batch = kept.kept(order, self.rows, self.device, self.model)

    def _rows_changed(self) -> None:
        self._decode_batch = None

    def _batch(self) -> _DecodeBatch:
        """Per-row tensors of the decode batch, rebuilt only when rows join or leave."""
        if self._decode_batch is None:
            self._decode_batch = _DecodeBatch.of(self.rows, self.device, self.model)
        return self._decode_batch


@dataclass
class _Prefilled:
    """A prefill's outputs. Row ``i``'s ``hidden[i, j]`` is prompt position ``starts[i] + j``
    (``starts[i]``: positions read from the prefix cache); each layer's ``kv`` is
    ``(b, kv_heads, >= len, head_dim)`` laid out by position."""

    hidden: torch.Tensor
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention layer -> K/V
    last_logits: torch.Tensor  # (b, vocab) after each prompt's last token
    lens: list[int]
    starts: list[int]
    states: PrefillStates | None = None  # hybrid models: each prompt's recurrent states
    pages: list[list[int]] = field(default_factory=list)  # a paged cache: each prompt's prefix-cache pages
    weights: list[tuple[int | None, int]] = field(default_factory=list)  # what computed each prompt's K/V
    cacheable: list[bool] = field(default_factory=list)  # whether the prefix cache may keep each prompt's


@dataclass
class _ChunkedPrefill:
    """A long prompt prefilled a chunk per scheduler step (:meth:`Sampler._prefill_next_chunk`)."""

    state: _TaskState
    prompt: list[int]
    weights: tuple[int | None, int] | None  # what its K/V are cached under; None: not cached (weights changed)
    kv: torch.Tensor  # (attention layers, 2, 1, kv_heads, len(prompt), head_dim): K/V of the positions done so far
    done: int  # prompt positions whose K/V are in ``kv``
    recurrent: PrefillStates | None = None  # hybrid models: the states after the chunks done
    hidden: list[torch.Tensor] = field(default_factory=list)  # each chunk's hidden states, when prompt logits are asked
    started: tuple[int | None, int] | None = None  # the weights its first positions were computed with

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.weights


def _rows_by_owner(states: list[_TaskState]) -> Counter[str | None]:
    """The rows each owner (API key) holds among ``states``: their sequences not finished yet.
    What fair admission and preemption weigh keys by."""
    held: Counter[str | None] = Counter()
    for st in states:
        held[st.task.owner] += st.remaining
    return held


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _needs_prompt_logits(inp: SampleInput) -> bool:
    """Does the request ask for something computed over every prompt position?"""
    return bool(inp.prompt_logprobs or inp.topk_prompt_logprobs or inp.target_prompt_ids is not None
                or inp.prompt_alt_tokens_k)


@dataclass
class _DecodeBatch:
    """What every decode step needs about its rows, as tensors built once per row set.

    Between changes to the batch, each step only feeds back its sampled tokens and advances
    the step counters: no per-step tensors are built from Python lists.
    """

    groups: Segments | RowGroups | RowSlots | None  # each row's adapter, as ``decode_rows`` lays it out
    last: torch.Tensor  # (n,) last token of each row: the next step's input
    keys: torch.Tensor  # (n,) int64 random-stream key of each row (seed, sample index)
    steps: torch.Tensor  # (n,) int64 tokens sampled so far (the stream position)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    rope_deltas: torch.Tensor | None  # (n,) multimodal RoPE offsets; None when every row's is 0
    kinds: RowKinds  # which rows are greedy / truncate, known without asking the device

    @classmethod
    def of(cls, rows: list[_Row], device: torch.device, model: CausalLM) -> _DecodeBatch:
        vocab = model.config.vocab_size
        groups = decode_rows(model, [row.state.task.slot for row in rows], device)
        params = [r.state.task.input.params for r in rows]
        # Two copies to the device for all of it (each copy of its own would wait for the stream).
        ints = to_device(np.array([[r.tokens[-1] for r in rows], [r.state.seed for r in rows],
                                   [r.sample_idx for r in rows], [len(r.tokens) for r in rows],
                                   [p.top_k for p in params], [r.state.rope_delta for r in rows]],
                                  dtype=np.int64), device)
        floats = to_device(np.array([[p.temperature for p in params], [p.top_p for p in params]],
                                    dtype=np.float32), device)
        last, seeds, samples, steps, top_k, deltas = ints.unbind(0)
        return cls(
            groups=groups,
            last=last,
            keys=row_keys(seeds, samples),
            steps=steps,
            temperature=floats[0],
            top_k=top_k,
            top_p=floats[1],
            kinds=RowKinds.of([p.temperature for p in params], [p.top_k for p in params],
                              [p.top_p for p in params], vocab, device),
            rope_deltas=deltas if any(r.state.rope_delta for r in rows) else None,
        )


    def kept(self, order: list[int], rows: list[_Row], device: torch.device, model: CausalLM) -> _DecodeBatch:
        """This batch's rows ``order`` (place -> old place) as the batch of ``rows``: the per-row
        tensors gathered on the device (so a burst queued and not yet read feeds its tokens and
        step counts through), what only the host knows (adapters, sampling kinds) made again."""
        at = to_device(np.asarray(order, dtype=np.int64), device)
        take = lambda t: t.index_select(0, at)  # noqa: E731
        params = [r.state.task.input.params for r in rows]
        return _DecodeBatch(
            groups=decode_rows(model, [row.state.task.slot for row in rows], device),
            last=take(self.last), keys=take(self.keys), steps=take(self.steps),
            temperature=take(self.temperature), top_k=take(self.top_k), top_p=take(self.top_p),
            kinds=RowKinds.of([p.temperature for p in params], [p.top_k for p in params],
                              [p.top_p for p in params], model.config.vocab_size, device),
            rope_deltas=None if self.rope_deltas is None else take(self.rope_deltas),
        )


def _default_kv_bytes(device: torch.device) -> int:
    """K/V budget when none is configured: unlimited (0) on CPU; on CUDA 40% of the memory free now
    within the process's share of the device (the rest for prefill activations, the prefix cache
    and training)."""
    if device.type != "cuda":
        return 0
    free, _ = device_memory.free_and_total(device)
    return int(0.4 * free)


def _top_logprobs(full: torch.Tensor, ks: list[int]) -> list[tuple[list[int], list[float]] | None]:
    """Each row's ``ks[r]`` largest logprobs (ids, values), None where ``ks[r]`` is 0.

    One ``topk`` over the rows that ask and one read-back, rather than one per row.
    """
    return _host_top_logprobs(_device_top_logprobs(full, ks), ks)


def _device_top_logprobs(full: torch.Tensor, ks: list[int]):
    """The device half of :func:`_top_logprobs`: ``topk`` over the rows that ask (None if none)."""
    asking = [r for r, k in enumerate(ks) if k > 0]
    if not asking:
        return None
    k_max = min(max(ks), full.shape[-1])
    rows = full if len(asking) == full.shape[0] else full.index_select(
        0, to_device(asking, full.device, torch.long))
    return asking, torch.topk(rows, k_max, dim=-1)


def _asking_rows(best: list[tuple[torch.Tensor, torch.Tensor]], ks: list[int]):
    """Every row's best (ids, logprobs) of each static step, as :func:`_device_top_logprobs`
    gives those of the rows that ask (the rows with ``ks[r] > 0``, whose k is at most their width)."""
    asking = [r for r, k in enumerate(ks) if k > 0]
    at = to_device(asking, best[0][0].device, torch.long)
    return [(asking, torch.return_types.topk((vals.index_select(0, at), ids.index_select(0, at))))
            for ids, vals in best]


def _host_top_logprobs(top, ks: list[int]) -> list[tuple[list[int], list[float]] | None]:
    """The host half of :func:`_top_logprobs`: read back, cut to each row's own k."""
    out: list[tuple[list[int], list[float]] | None] = [None] * len(ks)
    if top is None:
        return out
    asking, found = top
    return _tops_by_step(asking, [found.indices.tolist()], [found.values.tolist()], ks)[0]


def _tops_by_step(asking: list[int], ids: list, vals: list, ks: list[int]
                  ) -> list[list[tuple[list[int], list[float]] | None]]:
    """Per step, per row, the row's best (ids, logprobs) cut to its own k, from each step's
    ``(asking rows, k)`` ids and values read back (``asking``: the rows that ask, in order)."""
    out: list[list[tuple[list[int], list[float]] | None]] = [[None] * len(ks) for _ in ids]
    for step, row in enumerate(out):
        for i, r in enumerate(asking):
            k = min(ks[r], len(ids[step][i]))
            row[r] = (ids[step][i][:k], vals[step][i][:k])
    return out


def _row_segments(slots: list[int | None], width: int):
    """Contiguous (slot, start, end) segments for rows sorted by slot, each ``width`` wide."""
    segs: list[tuple[int | None, int, int]] = []
    for i, s in enumerate(slots):
        if segs and segs[-1][0] == s:
            segs[-1] = (s, segs[-1][1], (i + 1) * width)
        else:
            segs.append((s, i * width, (i + 1) * width))
    return segs
