"""The API keys file is read again when it changes, and at once on SIGHUP, without dropping work.

An added key works within seconds; a removed key is refused from then on, while a request it
made that is already in flight completes; a file that fails to load keeps the keys in force.
A '#' inside a key is part of it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import fb_proto_body, json_result, post_fb, raw_client, retrieve, sft_batch
from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.e2e

KEY_1 = "tml-reload-one#with-a-hash"
KEY_2 = "tml-reload-two"
KEY_3 = "tml-reload-three"
PICKED_UP_S = 6.0  # an edit is in force after the file poll (2 s) plus slack for a busy machine


def _accepted(srv: ServerProcess, key: str) -> bool:
    with raw_client(srv.base_url, key) as http:
        r = http.get("/api/v1/sessions")
    assert r.status_code in (200, 401), r.text
    return r.status_code == 200


def _eventually(check: Callable[[], bool], within: float) -> float:
    """Seconds until ``check()`` held; fails after ``within``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < within, f"not in force after {within} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _write(path, text: str) -> None:
    """Replace the file the way editors and config tools do (a new file renamed over it)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_keys_file_reloads(make_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# reload test\n{KEY_1}   # first tenant\n")
    # one long-poll outlasts the queued work even on a loaded machine: a removed key may not poll again
    srv = make_server(api_keys_file=keys, env={"TINSMITH_LONG_POLL_SECONDS": "55"})
    assert _accepted(srv, KEY_1) and not _accepted(srv, KEY_2)
    assert not _accepted(srv, KEY_1.split("#")[0])  # the part before '#' is not a key of its own

    # an edit is picked up by the poll, with no signal
    _write(keys, f"{KEY_1}\n{KEY_2}\n")
    _eventually(lambda: _accepted(srv, KEY_2), PICKED_UP_S)
    assert _accepted(srv, KEY_1)

    # KEY_1 queues work that takes seconds and waits for its end; meanwhile KEY_1 is removed
    with raw_client(srv.base_url, KEY_1) as http:
        sid = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        r = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": srv.base_model,
                                                    "lora_config": {"rank": 4}})
        model_id = r.json()["model_id"]
        json_result(http, r.json()["request_id"])
        batch = sft_batch(seed=3, n_seqs=16, seq_len=500, vocab=VOCAB)
        for seq_id in range(1, 13):  # one run's requests execute one after another: seconds of work
            rid = post_fb(http, fb_proto_body(model_id, seq_id, batch)).json()["request_id"]
    answer: dict = {}
    polling = threading.Event()

    def wait_for_result() -> None:
        with raw_client(srv.base_url, KEY_1) as http:
            polling.set()
            answer["response"] = retrieve(http, rid)
            answer["at"] = time.monotonic()

    waiter = threading.Thread(target=wait_for_result)
    waiter.start()
    polling.wait(10)
    time.sleep(0.5)  # the long-poll reaches the server (and passes its key check) before the key goes
    _write(keys, f"{KEY_2}\n{KEY_3}  # added\n")
    os.kill(srv.proc.pid, signal.SIGHUP)  # at once, not at the next poll
    removed_at = time.monotonic()
    assert _eventually(lambda: not _accepted(srv, KEY_1), 1.0) < 1.0
    assert _accepted(srv, KEY_3) and _accepted(srv, KEY_2)
    waiter.join(timeout=120)
    r = answer["response"]
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-protobuf"), r.text
    assert answer["at"] > removed_at  # it was still in flight when its key went away

    # a file that does not load keeps the keys in force, and says why once
    _write(keys, f"{KEY_2}\n{KEY_1} {KEY_3}\n")
    os.kill(srv.proc.pid, signal.SIGHUP)
    _eventually(lambda: "line 2: unexpected text after the key" in srv.log_text(), PICKED_UP_S)
    time.sleep(2.2)  # at least one poll more: the same broken file is not reported again
    assert srv.log_text().count("unexpected text after the key") == 1
    assert KEY_3 not in srv.log_text() and "tml-reload" not in srv.log_text()  # keys are never logged
    assert _accepted(srv, KEY_2) and _accepted(srv, KEY_3) and not _accepted(srv, KEY_1)
    keys.unlink()
    _eventually(lambda: "cannot read api keys file" in srv.log_text(), PICKED_UP_S)
    assert _accepted(srv, KEY_2)

    # fixed again: in force
    _write(keys, f"{KEY_1}\n")
    _eventually(lambda: _accepted(srv, KEY_1) and not _accepted(srv, KEY_2), PICKED_UP_S)
    assert srv.running and "Traceback" not in srv.log_text()
