"""Garbage collection in a serving process: the start-up heap frozen, young objects collected less
often, every pause counted (/metrics: tests/server/test_metrics.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

from tinsmith.gc_tuning import YOUNGEST_THRESHOLD, tuned_for_serving


def test_tuning_freezes_the_start_up_heap_and_counts_every_pause():
    # Its own process: freezing the test process's heap would outlive the test.
    script = textwrap.dedent("""
        import gc, json
        import torch  # a start-up heap of the size a server has
        from tinsmith.gc_tuning import PAUSES, YOUNGEST_THRESHOLD, release_at_exit, tune_for_serving
        start = gc.get_threshold()
        frozen = tune_for_serving()
        tracked = len(gc.get_objects())  # what later collections walk
        before = PAUSES.readings()
        kept = [[i] for i in range(50_000)]  # young objects that live: the youngest generation fills
        gc.collect(2)
        after = PAUSES.readings()
        threshold = gc.get_threshold()
        release_at_exit()
        print(json.dumps({"start": start, "frozen": frozen, "tracked": tracked, "threshold": threshold,
                          "before": before, "after": after, "unfrozen": gc.get_freeze_count()}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["frozen"] > 20_000 and r["tracked"] < r["frozen"] / 10, r
    assert r["threshold"][0] == YOUNGEST_THRESHOLD and r["threshold"][1:] == r["start"][1:]
    (_, young_before, _), (_, _, _), (_, old_before, _) = r["before"]
    (_, young_after, _), (_, _, _), (_, old_after, old_seconds) = r["after"]
    assert young_after > young_before  # 50,000 allocations: at least one young collection on the way
    assert old_after == old_before + 1 and old_seconds > 0  # the explicit full collection, timed
    assert r["unfrozen"] == 0


def test_tuned_for_a_block_then_as_before():
    # A benchmark running the worker as the server does, inside this test process: afterwards the
    # process collects as it did (nothing left frozen, its own thresholds).
    before = gc.get_threshold()
    with tuned_for_serving() as frozen:
        assert frozen > 10_000 and gc.get_freeze_count() > 10_000
        assert gc.get_threshold()[0] == YOUNGEST_THRESHOLD
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
