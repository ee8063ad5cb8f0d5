"""``tinsmith status``: the dashboard's summary, printed for a terminal.

It reads the same JSON as the dashboard (``GET /dashboard/api/summary``) with the same key, so
the two always agree: a key sees its own runs, an admin key every key's.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timezone

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _ago(iso: str | None) -> str:
    if not iso:
        return "-"
    return _age((datetime.now(timezone.utc) - datetime.fromisoformat(iso)).total_seconds()) + " ago"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers)] + [line(r) for r in rows]


def render(summary: dict) -> str:
    """The summary as plain text: server health, runs, queue and sampler snapshots."""
    me, server, h, t = summary["caller"], summary["server"], summary["health"], summary["throughput"]
    admin = me["admin"]
    who = f"key {me['owner']}" + (" (admin: all keys)" if admin else "") + (" (single-user mode)" if me["single_user"] else "")
    out = [f"tinsmith {server['version']}  up {_age(server['uptime_s'])}  {who}",
           f"base models: {', '.join(server['base_models'])}",
           f"memory: process {_bytes(h['process_rss_bytes'])}, host {_bytes(h['host_available_bytes'])} free of "
           f"{_bytes(h['host_total_bytes'])}; cpu {h['cpu_percent']:.0f}%"]
    for d in h["devices"]:
        util = "" if d["utilization_percent"] is None else f", {d['utilization_percent']:.0f}% busy"
        limit = "" if d.get("limit_bytes") is None else f" (this server may reserve {_bytes(d['limit_bytes'])})"
        retries = ("" if not d.get("allocator_retries") else  # each a cudaFree: a wait for every queued kernel
                   f"; its allocator gave memory back to fit {d['allocator_retries']} allocations (the device waited)")
        out.append(f"gpu {d['index']} {d['name']}: {_bytes(d['used_bytes'])} used of {_bytes(d['total_bytes'])}, "
                   f"{_bytes(d['allocated_bytes'])} allocated here{limit}{util}{retries}")
    out.append(f"last {t['window_s']}s: {t['tokens_trained']} tokens trained ({t['train_tokens_per_s']:.1f}/s), "
               f"{t['tokens_sampled']} sampled ({t['sample_tokens_per_s']:.1f}/s)")
    out += ["", f"training runs ({len(summary['runs'])})"]
    owner = ["owner"] if admin else []
    out += _table(["run", *owner, "base model", "rank", "steps", "status", "last activity"],
                  [[r["model_id"], *([r["owner"]] if admin else []), r["base_model"],
                    str(r["lora_rank"]) if r["is_lora"] else "full", str(r["steps"]), r["status"],
                    _ago(r["last_activity"])] for r in summary["runs"]])
    out += ["", f"queue ({len(summary['queue'])})"]
    out += _table(["request", "kind", "run", *owner, "state", "age"],
                  [[q["request_id"], q["kind"], q["model_id"] or "-", *([q["owner"]] if admin else []), q["state"],
                    _age(q["age_s"])] for q in summary["queue"]])
    if summary["samplers"]:
        out += ["", f"sampler snapshots in memory ({len(summary['samplers'])})"]
        out += _table(["sampler", *owner, "base model", "rank", "stored", "idle"],
                      [[s["key"], *([s["owner"]] if admin else []), s["base_model"], str(s["lora_rank"]),
                        "yes" if s["stored"] else "no", _age(s["idle_s"])] for s in summary["samplers"]])
    return "\n".join(out)


def run(base_url: str | None, api_key: str | None, as_json: bool) -> int:
    """``tinsmith status``: fetch the summary with the key and print it; the exit status says how it went."""
    base_url = (base_url or os.environ.get("TINKER_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    key = api_key or os.environ.get("TINKER_API_KEY")
    if not key:
        print("tinsmith status: no API key: pass --api-key or set TINKER_API_KEY", file=sys.stderr)
        return 2
    try:
        r = httpx.get(f"{base_url}/dashboard/api/summary", headers={"X-API-Key": key}, timeout=30)
    except httpx.HTTPError as e:
        print(f"tinsmith status: cannot reach {base_url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        print(f"tinsmith status: {base_url} answered {r.status_code}: {detail}", file=sys.stderr)
        return 1
    if as_json:
        print(r.text)
    else:
        print(render(r.json()))
    return 0
