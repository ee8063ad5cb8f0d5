"""Prometheus metrics of one server: what it is doing, how long work waits and runs, what it holds.

Two kinds of numbers, kept apart on purpose:

* **Events** (requests answered, jobs finished, tokens trained) are counted when they happen,
  in counters and histograms that ``prometheus_client`` makes cheap and thread-safe.
* **State** (queue depth, runs, snapshots, memory, checkpoint bytes) is read when Prometheus
  scrapes, by :class:`StateCollector`: nothing has to be kept up to date on the hot path, and a
  reading is never stale.

Every server has its own ``CollectorRegistry`` (never the process-wide default), so several
servers in one process (tests) do not clash. Labels are bounded: routes by their template,
operations by job kind, devices by index, tenants by their short key id (never the key).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter as CounterMetric, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from tinsmith.engine.scheduler import Job, Outcome
from tinsmith.gc_tuning import PAUSES
from tinsmith.server.health import read_health
from tinsmith.tenants import key_id

if TYPE_CHECKING:
    from tinsmith.server.state import ServerState

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Every job kind the engine runs: the ``operation`` label takes only these values.
OPERATIONS = ("create_model", "forward_backward", "forward", "optim_step", "sample", "save_weights",
              "save_weights_for_sampler", "save_weights_external", "load_weights", "unload_model")
TRAIN_KINDS = ("forward_backward", "forward")

# Queue waits run from milliseconds (an idle server) to minutes (a server shared by many keys).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Steps run from milliseconds (optim_step of a tiny adapter) to minutes (a large forward_backward).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServerMetrics:
    """The registry of one server and its event metrics; ``observe_job`` is the engine's hook."""

    def __init__(self, state: ServerState | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = CounterMetric(
            "tinsmith_http_requests", "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"], registry=r)
        self.http_seconds = Histogram(
            "tinsmith_http_request_duration_seconds", "Time to answer an HTTP request (retrieve_future "
            "long-polls included), by route template", ["route", "method"], buckets=HTTP_BUCKETS, registry=r)
        self.jobs = CounterMetric(
            "tinsmith_operations", "Operations finished, by kind and outcome (ok, or the error category)",
            ["operation", "outcome"], registry=r)
        self.queue_wait = Histogram(
            "tinsmith_queue_wait_seconds", "Time an operation waited between being accepted and starting to run",
            ["operation"], buckets=WAIT_BUCKETS, registry=r)
        self.step_seconds = Histogram(
            "tinsmith_step_seconds", "Time an operation ran on the worker, from its start to its result being "
            "stored (forward_backward shares its device time with other keys' passes)",
            ["operation"], buckets=STEP_BUCKETS, registry=r)
        self.train_tokens = CounterMetric(
            "tinsmith_train_tokens", "Input tokens of finished forward_backward and forward requests",
            ["operation"], registry=r)
        for op in OPERATIONS:  # every series exists from the start: rate() and dashboards see zeros
            self.queue_wait.labels(op)
            self.step_seconds.labels(op)
            self.jobs.labels(op, "ok")
        for op in TRAIN_KINDS:
            self.train_tokens.labels(op)
        if state is not None:
            r.register(StateCollector(state))

    # ----------------------------------------------------------------------------- events
    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_seconds.labels(route, method).observe(seconds)

    def observe_job(self, job: Job, outcome: Outcome) -> None:
        """A job finished (engine event loop): count it, its wait, its run time and its tokens."""
        op = job.kind if job.kind in OPERATIONS else "other"
        self.jobs.labels(op, "ok" if outcome.error is None else outcome.category).inc()
        if job.started_at is not None:
            self.queue_wait.labels(op).observe(max(0.0, job.started_at - job.enqueued_at))
            end = job.finished_at if job.finished_at is not None else time.monotonic()
            self.step_seconds.labels(op).observe(max(0.0, end - job.started_at))
        if op in TRAIN_KINDS and outcome.error is None:
            self.train_tokens.labels(op).inc(sum(len(d.tokens) for d in job.args.data))

    # ----------------------------------------------------------------------------- exposition
    def render(self) -> bytes:
        """The text exposition format (blocking: it may query the database; run it off the event loop)."""
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class StateCollector:
    """Reads the server's state at scrape time. Every reading copies before it iterates (the
    engine and worker change their state on other threads) and one that fails is left out,
    never guessed: a scrape answers even when, say, the database is down."""

    def __init__(self, state: ServerState):
        self.state = state

    def describe(self) -> list[Metric]:
        # The families without reading anything: registering must not touch the database.
        return list(self._families(read=False))

    def collect(self) -> list[Metric]:
        return list(self._families(read=True))

    def _families(self, read: bool) -> Iterable[Metric]:
        for part in (self._queue, self._holdings, self._sampling, self._health, self._garbage, self._storage):
            families, fill = part()
            if read:
                try:
                    fill(*families)
                except Exception:  # noqa: BLE001 - one bad reading must not fail the scrape
                    log.warning("metrics: reading %s failed", part.__name__.lstrip("_"), exc_info=True)
            yield from families

    # Each part returns its families and a function that fills them in.
    def _queue(self) -> tuple[list[Metric], Callable]:
        depth = _gauge("tinsmith_queue_depth", "Operations accepted and waiting to run, by kind "
                       "(sample: waiting to join the sampler's batch)", ["operation"])
        oldest = _gauge("tinsmith_queue_oldest_wait_seconds", "How long the oldest waiting operation of each kind "
                        "has waited so far (0 when none waits)", ["operation"])
        in_flight = _gauge("tinsmith_requests_in_flight", "Operations queued or running, every key together")
        gaps = CounterMetricFamily("tinsmith_seq_gaps_skipped", "Requests run without an earlier seq_id of their run "
                                   "after waiting --seq-gap-wait-s for it")
        together = CounterMetricFamily("tinsmith_optimizer_steps_together", "Optimizer steps taken together with "
                                       "other runs' steps that were ready at the same time (one read-back and one "
                                       "set of kernels for all)")
        turns = CounterMetricFamily("tinsmith_engine_turn_seconds", "Seconds of the engine's turns on the device, "
                                    "by kind (train: single jobs and forward/backward chunks; sample: decode "
                                    "slices); the kinds share the device by time per API key with work", labels=["kind"])

        def fill(depth, oldest, in_flight, gaps, together, turns):
            engine, ops = self.state.engine, self.state.engine.ops
            jobs = engine.queued_jobs()
            jobs += list(getattr(ops, "_sample_inbox", ()))
            jobs += [t.key for s in list(self.state.worker.samplers.values()) for t in list(s.inbox)]
            counts, first = Counter(j.kind for j in jobs), {}
            for j in jobs:
                first[j.kind] = min(first.get(j.kind, j.enqueued_at), j.enqueued_at)
            now = time.monotonic()
            for op in OPERATIONS:
                depth.add_metric([op], counts.get(op, 0))
                oldest.add_metric([op], now - first[op] if op in first else 0.0)
            in_flight.add_metric([], engine.in_flight_total())
            gaps.add_metric([], engine.stats["seq_gaps_skipped"])
            together.add_metric([], engine.stats["optimizer_steps_together"])
            for kind, seconds in dict(engine.shares.spent).items():
                turns.add_metric([kind], seconds)

        return [depth, oldest, in_flight, gaps, together, turns], fill

    def _holdings(self) -> tuple[list[Metric], Callable]:
        runs = _gauge("tinsmith_training_runs", "Training runs held in memory, by type (lora, full)", ["type"])
        adapters = _gauge("tinsmith_lora_adapters", "LoRA adapters of training runs: resident on the device, or "
                          "parked in host memory until their run's next step", ["state"])
        snapshots = _gauge("tinsmith_sampler_snapshots", "Sampler snapshots held in memory, by whether they are "
                           "stored on disk (evicting those loses nothing)", ["stored"])
        evictions = CounterMetricFamily("tinsmith_sampler_snapshot_evictions", "Sampler snapshots evicted to make "
                                        "room for another")
        sessions = _gauge("tinsmith_active_sessions", "Client sessions not yet finished (closed or timed out)")
        full_snapshots = _gauge("tinsmith_full_sampler_snapshot_bytes", "Host memory of full fine-tunes' sampler "
                                "snapshots, and of those resident on the device now", ["where"])
        live_bytes = _gauge("tinsmith_inflight_copy_bytes", "Device memory of the whole copies of sharded full "
                            "fine-tunes' weights that their inflight samplers read (rank 0)")
        gathers = CounterMetricFamily("tinsmith_inflight_weight_gathers", "Times a sharded full fine-tune's whole "
                                      "weights were gathered for its inflight samplers (after a step or load)")

        def fill(runs, adapters, snapshots, evictions, sessions, full_snapshots, live_bytes, gathers):
            worker = self.state.worker
            placements = list(worker.placements.values())
            lora = sum(1 for p in placements if p.is_lora)
            runs.add_metric(["lora"], lora)
            runs.add_metric(["full"], len(placements) - lora)
            resident = sum(len(b.lora.lru) for b in list(worker.bases.values()))
            adapters.add_metric(["resident"], resident)
            adapters.add_metric(["parked"], max(0, lora - resident))
            snaps = list(worker.snapshots.values())
            stored = sum(1 for s in snaps if s.reloadable)
            snapshots.add_metric(["true"], stored)
            snapshots.add_metric(["false"], len(snaps) - stored)
            evictions.add_metric([], worker.stats["snapshot_evictions"])
            full = [s for s in snaps if s.is_full]
            full_snapshots.add_metric(["host"], sum(s.host_bytes for s in full))
            full_snapshots.add_metric(["device"], sum(s.host_bytes for s in full if s.model is not None))
            sessions.add_metric([], self.state.store.count_live_sessions())
            live_bytes.add_metric([], sum(p.numel() * p.element_size() for live in list(worker.live_copies.values())
                                          for p in live.model.parameters()))
            gathers.add_metric([], worker.stats["live_weight_gathers"])

        return [runs, adapters, snapshots, evictions, sessions, full_snapshots, live_bytes, gathers], fill

    def _sampling(self) -> tuple[list[Metric], Callable]:
        sampled = CounterMetricFamily("tinsmith_sampled_tokens", "Tokens of the sequences sampled for clients")
        rows = _gauge("tinsmith_sampler_rows", "Sequences being decoded right now")
        key_rows = _gauge("tinsmith_sampler_key_rows", "Sampling rows of each API key: decoding (its sequences in "
                          "the batch) and waiting (the rows its queued requests ask for; the batch's rows go "
                          "to keys in turns)", ["key_id", "state"])
        kv = _gauge("tinsmith_kv_cache_bytes", "Bytes of the samplers' KV caches (they grow with the batch and "
                    "shrink when it empties)")
        kv_used = _gauge("tinsmith_kv_cache_used_bytes", "Of those, the bytes the decoding sequences hold (paged "
                         "caches: the pages some sequence holds, a shared prompt page once; pages only the "
                         "prefix cache holds count in tinsmith_prefix_cache_bytes)")
        prefix = _gauge("tinsmith_prefix_cache_bytes", "Bytes of prompt K/V (hybrid models: whole prompts' "
                        "states) the samplers keep for later requests (--prefix-cache-bytes each)")
        # name -> (the samplers' counter it reads, help)
        totals = {
            "tinsmith_prefill_tokens": ("prefill_tokens", "Prompt tokens the samplers computed"),
            "tinsmith_prompt_cache_hit_tokens": ("cached_prompt_tokens", "Prompt tokens not computed: read from "
                                                 "the prefix cache, a kept prompt or another request's prefill"),
            "tinsmith_sampler_preemptions": ("preempted", "Requests preempted to keep the K/V cache within "
                                             "--sampler-kv-cache-bytes, or to give rows to a key below its fair "
                                             "share (resumed later, their K/V recomputed)"),
            "tinsmith_sampler_yielded_rows": ("yielded_rows", "Rows taken back from keys above their fair share "
                                              "of a sampler's batch for a key below it that waited (those "
                                              "requests resume after it)"),
            "tinsmith_sampler_recomputed_tokens": ("recomputed_tokens", "Tokens prefilled again to resume preempted "
                                                   "requests"),
            "tinsmith_decode_graph_replays": ("graph_replays", "Decode steps replayed from CUDA graphs"),
            "tinsmith_decode_graph_captures": ("graph_captures", "Decode steps captured as CUDA graphs (each "
                                               "batch-size bucket and adapter mix once, again when the K/V "
                                               "cache or an adapter bank moves)"),
            "tinsmith_decode_steps": ("decode_steps", "Decode steps the samplers ran (a step advances every row)"),
            "tinsmith_decode_reads": ("decode_reads", "Read-backs of decode bursts' sampled tokens (one a burst of "
                                      "steps)"),
            "tinsmith_decode_bursts_ahead": ("bursts_ahead", "Decode bursts queued before the tokens of the burst "
                                             "before them were read (--sampler-run-ahead)"),
            "tinsmith_sampler_prefills": ("prefills", "Prefill passes the samplers ran (each admission of waiting "
                                          "requests runs one)"),
            "tinsmith_sampler_admissions": ("admissions", "Requests the samplers admitted into their batch"),
            "tinsmith_sampler_admission_wait_seconds": ("admission_wait_s", "Seconds admitted requests waited in "
                                                        "a sampler's queue for rows, K/V room or their turn among "
                                                        "keys (divide by tinsmith_sampler_admissions_total)"),
            "tinsmith_sampler_admitting_seconds": ("admitting_s", "Seconds the samplers spent admitting "
                                                   "requests (prefill, first tokens, K/V stored), while their "
                                                   "decoding rows waited"),
        }
        counters = [CounterMetricFamily(name, text) for name, (_, text) in totals.items()]

        def fill(sampled, rows, key_rows, kv, kv_used, prefix, *counters):
            samplers = list(self.state.worker.samplers.values())
            sampled.add_metric([], self.state.engine.ops.throughput.sampled.all_time)
            rows.add_metric([], sum(len(s.rows) for s in samplers))
            queued = list(getattr(self.state.engine.ops, "_sample_inbox", ()))  # not handed to a sampler yet
            for (owner, state), n in sorted(_key_rows(samplers, queued).items()):
                key_rows.add_metric([key_id(owner), state], n)
            kv.add_metric([], sum(s.cache.nbytes() for s in samplers))
            kv_used.add_metric([], sum(s.cache.used_bytes(len(s.rows)) for s in samplers))
            prefix.add_metric([], sum(s.prefix.bytes + s.snapshots.bytes for s in samplers))
            total = self.state.worker.sampler_totals()
            for family, (stat, _) in zip(counters, totals.values()):
                family.add_metric([], total.get(stat, 0))

        return [sampled, rows, key_rows, kv, kv_used, prefix, *counters], fill


    def _health(self) -> tuple[list[Metric], Callable]:
        rss = _gauge("tinsmith_process_memory_bytes", "Resident memory of the server process")
        host_total = _gauge("tinsmith_host_memory_total_bytes", "Memory of the host")
        host_free = _gauge("tinsmith_host_memory_available_bytes", "Memory of the host available to new work")
        cpu = _gauge("tinsmith_host_cpu_percent", "CPU use of the host since the previous reading (percent)")
        dev_total = _gauge("tinsmith_device_memory_total_bytes", "Memory of each accelerator", ["device"])
        dev_used = _gauge("tinsmith_device_memory_used_bytes", "Memory in use on each accelerator, every process "
                          "counted", ["device"])
        dev_alloc = _gauge("tinsmith_device_memory_allocated_bytes", "Accelerator memory held by this server's "
                           "tensors", ["device"])
        dev_reserved = _gauge("tinsmith_device_memory_reserved_bytes", "Accelerator memory reserved by this "
                              "server's caching allocator", ["device"])
        dev_limit = _gauge("tinsmith_device_memory_limit_bytes", "Accelerator memory this server's caching allocator "
                           "may reserve (--device-memory-fraction; absent when it is not capped)", ["device"])
        dev_util = _gauge("tinsmith_device_utilization_percent", "Accelerator load (percent of time a kernel ran; "
                          "absent where NVML is not installed)", ["device"])
        dev_retries = CounterMetricFamily("tinsmith_device_allocator_retries", "Times this server's caching "
                                          "allocator gave its cached blocks back to the driver to fit an allocation",
                                          labels=["device"])
        dev_frees = CounterMetricFamily("tinsmith_device_frees", "cudaFree calls of this server's caching allocator "
                                        "(each waits for everything queued on the device)", labels=["device"])

        def fill(rss, host_total, host_free, cpu, dev_total, dev_used, dev_alloc, dev_reserved, dev_limit, dev_util,
                 dev_retries, dev_frees):
            h = read_health()
            rss.add_metric([], h.process_rss_bytes)
            host_total.add_metric([], h.host_total_bytes)
            host_free.add_metric([], h.host_available_bytes)
            cpu.add_metric([], h.cpu_percent)
            for d in h.devices:
                label = [str(d.index)]
                for family, value in ((dev_total, d.total_bytes), (dev_used, d.used_bytes),
                                      (dev_alloc, d.allocated_bytes), (dev_reserved, d.reserved_bytes),
                                      (dev_limit, d.limit_bytes), (dev_util, d.utilization_percent),
                                      (dev_retries, d.allocator_retries), (dev_frees, d.device_frees)):
                    if value is not None:  # unreadable here: left out, never a made-up zero
                        family.add_metric(label, value)

        return [rss, host_total, host_free, cpu, dev_total, dev_used, dev_alloc, dev_reserved, dev_limit, dev_util,
                dev_retries, dev_frees], fill

    def _garbage(self) -> tuple[list[Metric], Callable]:
        collections = CounterMetricFamily("tinsmith_gc_collections", "Python's cyclic garbage collections in the "
                                          "server process, by generation (2: the oldest)", labels=["generation"])
        paused = CounterMetricFamily("tinsmith_gc_pause_seconds", "Time those collections held the server process "
                                     "(no thread runs meanwhile), by generation", labels=["generation"])
        frozen = _gauge("tinsmith_gc_frozen_objects", "Start-up objects exempt from garbage collection")

        def fill(collections, paused, frozen):
            if not PAUSES.installed:  # a server embedded in another program: its collector is not ours to read
                return
            for generation, count, seconds in PAUSES.readings():
                collections.add_metric([str(generation)], count)
                paused.add_metric([str(generation)], seconds)
            frozen.add_metric([], gc.get_freeze_count())

        return [collections, paused, frozen], fill

    def _storage(self) -> tuple[list[Metric], Callable]:
        ckpt = _gauge("tinsmith_checkpoint_bytes", "Bytes of stored checkpoints, by API key id", ["key_id"])

        def fill(ckpt):
            for owner, size in sorted(self.state.store.storage_bytes_by_owner().items()):
                ckpt.add_metric([key_id(owner)], size)

        return [ckpt], fill


def _key_rows(samplers: list, queued: list) -> Counter[tuple[str, str]]:
    """(owner, "decoding" | "waiting") -> rows: the samplers' rows and queues, and sample jobs
    ``queued`` for a sampler. Read from the scrape's thread: each list is copied before it is read
    (the worker's thread changes them)."""
    out: Counter[tuple[str, str]] = Counter()
    for s in samplers:
        for row in list(s.rows):
            out[(row.state.task.owner or "", "decoding")] += 1
        for task in list(s.inbox):
            out[(task.owner or "", "waiting")] += task.input.num_samples
    for job in queued:
        out[(job.owner, "waiting")] += job.args.input.num_samples
    return out
