"""glibc's allocator set for serving (tinsmith.host_malloc): a large tensor made again and again comes
from the heap and is faulted in once, not mapped afresh every time; an operator's own allocator
settings are left alone.

Each case runs in a fresh interpreter: the settings are process-wide and must come before threads.
Page faults are the symptom, but their count per step is not exact: until the heap's layout
settles (about ten steps of this one), a step now and then finds no free block where the last one
freed its tensors (small allocations sit between them) and grows the heap, faulting the new part
in. So what decides is where glibc put the step's tensors (``mallinfo2``'s mapped bytes), and the
faults are compared in sum, the tuned process's against the default one's."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

_LIBC, _LIBC_VERSION = platform.libc_ver()
pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or _LIBC != "glibc"
    or tuple(int(x) for x in _LIBC_VERSION.split(".")[:2]) < (2, 33),
    reason="glibc's allocator only (Linux), 2.33 or later (mallinfo2)")

_FAULTS = """
import ctypes, json, resource, sys, threading
from tinsmith.host_malloc import tune_for_serving

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (2.33 and later)
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2
why = tune_for_serving() if sys.argv[1] == "tuned" else "not asked"
import torch

faults, mapped = [], []

torch.set_num_threads(1)  # every page the step touches is faulted by its own thread, whatever the cores

def steps():  # on a thread of its own, as the server's device work runs
    logits = torch.randn(64, 151936)  # a 64-row decode step's logits over Qwen3's vocabulary: 39 MB
    for _ in range(12):
        before, mapped_before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, mallinfo2().hblkhd
        p = torch.softmax(logits, -1)  # the token choice's tensors of that size, made and freed every step
        c = p.cumsum(-1)
        mapped.append(mallinfo2().hblkhd - mapped_before)  # bytes glibc mapped for p and c, not from the heap
        s = (c * 2).sum()
        del p, c, s
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

t = threading.Thread(target=steps)
t.start()
t.join()
print(json.dumps({"why": why, "faults": faults, "mapped": mapped}))
"""


def _run(mode: str, env: dict | None = None) -> dict:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}, **(env or {})}
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_TENSOR = 64 * 151936 * 4  # bytes
_PAGES = _TENSOR // 4096


def test_a_steps_large_tensors_are_not_faulted_in_every_step():
    """By default glibc maps each 39 MB tensor afresh and the kernel faults its pages in, every
    step; tuned, they come from the heap, which keeps the memory: after the first step's faults,
    only a step that grows the heap faults, until its layout settles."""
    default, tuned = _run("default"), _run("tuned")
    assert tuned["why"] is None, tuned
    assert min(default["mapped"]) >= 2 * _TENSOR and min(default["faults"]) > 2 * _PAGES, default
    assert max(tuned["mapped"]) == 0, tuned
    assert tuned["faults"][0] > 2 * _PAGES, tuned  # the heap grows to the step's peak once
    assert sum(tuned["faults"][2:]) < sum(default["faults"][2:]) / 2, (tuned, default)


def test_the_operators_settings_are_left_alone():
    r = _run("tuned", {"MALLOC_ARENA_MAX": "4"})
    assert "MALLOC_ARENA_MAX" in r["why"]
    assert min(r["mapped"]) >= 2 * _TENSOR and min(r["faults"]) > 2 * _PAGES  # glibc's own behaviour, untouched
