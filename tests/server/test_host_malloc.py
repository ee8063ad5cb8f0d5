"""glibc's allocator set for serving (tinsmith.host_malloc): a large tensor made again and again is
faulted in once, not every time; an operator's own allocator settings are left alone.

Each case runs in a fresh interpreter: the settings are process-wide and must come before threads."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's allocator only (Linux)")

_FAULTS = """
import json, resource, sys, threading
from tinsmith.host_malloc import tune_for_serving
why = tune_for_serving() if sys.argv[1] == "tuned" else "not asked"
import torch

faults = []

def steps():  # on a thread of its own, as the server's device work runs
    logits = torch.randn(64, 151936)  # a 64-row decode step's logits over Qwen3's vocabulary: 39 MB
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        p = torch.softmax(logits, -1)  # the token choice's tensors of that size, made and freed every step
        c = p.cumsum(-1)
        s = (c * 2).sum()
        del p, c, s
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

t = threading.Thread(target=steps)
t.start()
t.join()
print(json.dumps({"why": why, "faults": faults}))
"""


def _run(mode: str, env: dict | None = None) -> dict:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}, **(env or {})}
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_steps_large_tensors_are_not_faulted_in_every_step():
    """By default glibc maps each 39 MB tensor afresh and the kernel faults its pages in, every
    step; tuned, the heap keeps the memory and the steps stop faulting after the first few."""
    default, tuned = _run("default"), _run("tuned")
    assert tuned["why"] is None, tuned
    assert min(default["faults"]) > 4000, default
    assert tuned["faults"][0] > 4000 and max(tuned["faults"][-2:]) < 100, tuned


def test_the_operators_settings_are_left_alone():
    r = _run("tuned", {"MALLOC_ARENA_MAX": "4"})
    assert "MALLOC_ARENA_MAX" in r["why"]
    assert min(r["faults"]) > 4000  # glibc's own behaviour, untouched
