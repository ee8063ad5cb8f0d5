"""Checkpoint and training-run REST resources through the SDK's ``RestClient`` (and raw HTTP
where the SDK would retry a 409 for minutes), plus the TTL sweeper."""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import tinker

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, detail, raw_client, sft_batch
from tests.rl.helpers import checkpoint_dir, train_steps_on

API_KEY = "tml-rl-rest"
METADATA = {"purpose": "rest-test", "owner": "rl-suite"}


@pytest.fixture(scope="module")
def rest_server(make_server):
    """A server of its own, so that the user-wide listings hold only this module's checkpoints."""
    return make_server()


@pytest.fixture(scope="module")
def run(rest_server, base_model):
    """One run with four checkpoints, saved in the order a, b, c, d."""
    sc = tinker.ServiceClient(base_url=rest_server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=3, user_metadata=METADATA).result(
        timeout=RESULT_TIMEOUT_S)
    train_steps_on(tc, sft_batch(seed=5, n_seqs=2, seq_len=12, vocab=VOCAB), 2, 1e-2)
    paths = {
        "a": tc.save_state("a", user_metadata={"step": "2"}).result(timeout=RESULT_TIMEOUT_S).path,
        "b": tc.save_weights_for_sampler("b").result(timeout=RESULT_TIMEOUT_S).path,
        "c": tc.save_weights_external("c").result(timeout=RESULT_TIMEOUT_S).path,
        "d": tc.save_state("d").result(timeout=RESULT_TIMEOUT_S).path,
    }
    yield {"sc": sc, "tc": tc, "run_id": str(tc.model_id), "paths": paths}
    sc.close("success").result(timeout=60)


@pytest.fixture
def rest(rest_server):
    return tinker.RestClient(base_url=rest_server.base_url, api_key=API_KEY)


def _r(fut):
    return fut.result(timeout=RESULT_TIMEOUT_S)


def _ckpt_url(run_id: str, path: str, suffix: str = "") -> str:
    kind, name = path.rsplit("/", 2)[-2:]
    return f"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}{suffix}"


@pytest.mark.e2e
def test_training_runs(run, rest, rest_server):
    listing = _r(rest.list_training_runs())
    ids = [r.training_run_id for r in listing.training_runs]
    assert run["run_id"] in ids
    assert listing.cursor.total_count == len(ids) and listing.cursor.offset == 0

    tr = _r(rest.get_training_run_by_tinker_path(run["paths"]["a"]))
    assert tr.training_run_id == run["run_id"]
    assert tr.user_metadata == METADATA
    assert tr.is_lora and tr.lora_rank == 4 and not tr.corrupted
    assert tr.last_checkpoint is not None and tr.last_checkpoint.tinker_path == run["paths"]["d"]
    assert tr.last_sampler_checkpoint is not None and tr.last_sampler_checkpoint.tinker_path == run["paths"]["b"]

    # the deprecated way the cookbook still uses gets the same answer
    with pytest.warns(FutureWarning):
        via_sc = run["sc"].create_rest_client()
    assert _r(via_sc.get_training_run(run["run_id"])).user_metadata == METADATA


@pytest.mark.e2e
def test_checkpoint_listings(run, rest):
    p = run["paths"]
    ck = {c.tinker_path: c for c in _r(rest.list_checkpoints(run["run_id"])).checkpoints}
    assert set(p.values()) <= set(ck)
    assert ck[p["a"]].checkpoint_type == "training" and ck[p["a"]].checkpoint_id == "weights/a"
    assert ck[p["b"]].checkpoint_type == "sampler" and ck[p["b"]].checkpoint_id == "sampler_weights/b"
    assert ck[p["c"]].checkpoint_type == "external" and ck[p["c"]].checkpoint_id == "external_weights/c"
    assert ck[p["a"]].user_metadata == {"step": "2"}
    assert all((c.size_bytes or 0) > 0 for c in ck.values())
    assert all(not c.public and c.expires_at is None for c in ck.values())

    mine = _r(rest.list_user_checkpoints())
    paths = [c.tinker_path for c in mine.checkpoints]
    times = [c.time for c in mine.checkpoints]
    assert times == sorted(times, reverse=True), "newest first"
    ours = [x for x in paths if x in p.values()]
    assert ours == [p["d"], p["c"], p["b"], p["a"]]
    assert mine.cursor is not None and mine.cursor.total_count == len(paths)
    page = _r(rest.list_user_checkpoints(limit=2, offset=1))
    assert [c.tinker_path for c in page.checkpoints] == paths[1:3]
    assert page.cursor.total_count == len(paths) and (page.cursor.limit, page.cursor.offset) == (2, 1)


@pytest.mark.e2e
def test_publish_unpublish(run, rest, rest_server):
    path = run["paths"]["b"]
    _r(rest.publish_checkpoint_from_tinker_path(path))
    assert _public(rest, run, path) is True
    with raw_client(rest_server.base_url, API_KEY) as http:
        r = http.post(_ckpt_url(run["run_id"], path, "/publish"))
        assert r.status_code == 409 and "already public" in detail(r)
    _r(rest.unpublish_checkpoint_from_tinker_path(path))
    assert _public(rest, run, path) is False
    with raw_client(rest_server.base_url, API_KEY) as http:
        r = http.delete(_ckpt_url(run["run_id"], path, "/publish"))
        assert r.status_code == 409 and "already private" in detail(r)
        r = http.post(_ckpt_url(run["run_id"], "x/nope", "/publish").replace("/x/", "/sampler_weights/"))
        assert r.status_code == 404 and "nope" in detail(r)


def _public(rest, run, path) -> bool:
    return {c.tinker_path: c for c in _r(rest.list_checkpoints(run["run_id"])).checkpoints}[path].public


@pytest.mark.e2e
def test_ttl(run, rest, rest_server):
    path = run["paths"]["d"]

    def expires():
        return {c.tinker_path: c for c in _r(rest.list_checkpoints(run["run_id"])).checkpoints}[path].expires_at

    before = datetime.now(timezone.utc)
    _r(rest.set_checkpoint_ttl_from_tinker_path(path, 7200))
    exp = expires()
    assert exp is not None
    assert before + timedelta(seconds=7190) <= exp <= datetime.now(timezone.utc) + timedelta(seconds=7210)
    _r(rest.set_checkpoint_ttl_from_tinker_path(path, None))
    assert expires() is None
    with raw_client(rest_server.base_url, API_KEY) as http:
        for bad in (10, 3599, 11 * 365 * 24 * 3600, -1):
            r = http.put(_ckpt_url(run["run_id"], path, "/ttl"), json={"ttl_seconds": bad})
            assert r.status_code == 400, (bad, r.status_code, r.text)
            assert "ttl_seconds" in detail(r)
    assert expires() is None  # the refused calls changed nothing


@pytest.mark.e2e
def test_weights_info(run, rest):
    for key in ("a", "b", "c"):
        info = _r(rest.get_weights_info_by_tinker_path(run["paths"][key]))
        assert info.is_lora and info.lora_rank == 4
        assert info.train_attn and info.train_mlp and info.train_unembed


@pytest.mark.e2e
def test_external_weights_download(run, rest, rest_server):
    path = run["paths"]["c"]
    resp = _r(rest.get_external_weights_urls(path))
    on_disk = checkpoint_dir(rest_server, path)
    files = {f.name for f in on_disk.iterdir() if f.is_file()}
    assert set(resp.urls) == files and "adapter_model.safetensors" in files
    assert resp.expires > datetime.now(timezone.utc) + timedelta(minutes=5)
    for rel, url in resp.urls.items():
        r = httpx.get(url, timeout=30)  # plain, unauthenticated GET, as the CLI does
        assert r.status_code == 200, (rel, r.status_code)
        assert r.content == (on_disk / rel).read_bytes(), rel

    url = resp.urls["adapter_model.safetensors"]
    parts = urllib.parse.urlsplit(url)
    segs = parts.path.split("/")  # .../downloads/RUN/NAME/EXPIRES/SIG/FILE
    sig = segs[-2]
    tampered = [
        segs[:-2] + [("0" if sig[0] != "0" else "1") + sig[1:], segs[-1]],  # signature changed
        segs[:-3] + [str(int(segs[-3]) + 60), sig, segs[-1]],  # expiry extended
        segs[:-4] + ["d"] + segs[-3:],  # another checkpoint's name under this signature
    ]
    for t in tampered:
        r = httpx.get(urllib.parse.urlunsplit(parts._replace(path="/".join(t))), timeout=30)
        assert r.status_code == 403, (t, r.status_code, r.text)
    # an expired link is refused even with a matching signature format
    past = segs[:-3] + [str(int(time.time()) - 10), sig, segs[-1]]
    assert httpx.get(urllib.parse.urlunsplit(parts._replace(path="/".join(past))), timeout=30).status_code == 403


@pytest.mark.e2e
def test_delete_checkpoint(run, rest, rest_server, base_model):
    path = run["paths"]["a"]
    on_disk = checkpoint_dir(rest_server, path)
    assert on_disk.is_dir()
    _r(rest.delete_checkpoint_from_tinker_path(path))
    assert path not in [c.tinker_path for c in _r(rest.list_checkpoints(run["run_id"])).checkpoints]
    assert path not in [c.tinker_path for c in _r(rest.list_user_checkpoints()).checkpoints]
    assert not on_disk.exists()
    with pytest.raises(tinker.TinkerError) as exc:
        run["sc"].create_training_client_from_state(path).result(timeout=RESULT_TIMEOUT_S)
    assert "weights/a" in str(exc.value)
    with raw_client(rest_server.base_url, API_KEY) as http:
        r = http.delete(_ckpt_url(run["run_id"], path))
        assert r.status_code == 404 and "weights/a" in detail(r)
    # the other checkpoints of the run are untouched
    assert _r(rest.get_weights_info_by_tinker_path(run["paths"]["d"])).is_lora


# ------------------------------------------------------------------------------------ TTL sweeper
def _sweeper_state(tmp_path):
    from tinsmith.server.config import ServerConfig
    from tinsmith.server.state import ServerState
    from tinsmith.store import Store

    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    cfg = ServerConfig(data_dir=str(tmp_path))
    return ServerState(cfg, store, worker=None, engine=None, auth=None)


def _fake_checkpoint(state, tmp_path, name: str, expires_at):
    d = tmp_path / "checkpoints" / "run:train:0" / "weights" / name
    d.mkdir(parents=True)
    (d / "weights.safetensors").write_bytes(b"x" * 100)
    state.store.put_checkpoint("run:train:0", "weights", name, owner="local", storage_path=str(d),
                               size_bytes=100, expires_at=expires_at)
    return d


def test_sweep_removes_expired_checkpoints(tmp_path):
    state = _sweeper_state(tmp_path)
    now = datetime.now(timezone.utc)
    gone = _fake_checkpoint(state, tmp_path, "old", now - timedelta(seconds=1))
    later = _fake_checkpoint(state, tmp_path, "later", now + timedelta(hours=1))
    forever = _fake_checkpoint(state, tmp_path, "forever", None)
    try:
        assert state.sweep_expired_checkpoints() == 1
        assert not gone.exists() and state.store.get_checkpoint("run:train:0", "weights", "old") is None
        for d, name in ((later, "later"), (forever, "forever")):
            assert d.is_dir() and state.store.get_checkpoint("run:train:0", "weights", name) is not None
        assert state.sweep_expired_checkpoints() == 0
        assert state.store.owner_storage_bytes("local") == 200  # the quota no longer counts it
    finally:
        state.store.close()


def test_sweeper_task_runs_every_interval(tmp_path):
    state = _sweeper_state(tmp_path)
    state.sweep_interval_s = 0.02
    now = datetime.now(timezone.utc)

    async def scenario():
        task = asyncio.create_task(state._sweeper())
        try:
            await asyncio.sleep(0.1)
            # expires while the sweeper is already running: picked up on a later round
            d = _fake_checkpoint(state, tmp_path, "soon", now - timedelta(milliseconds=1))
            for _ in range(200):
                if not d.exists():
                    break
                await asyncio.sleep(0.02)
            return d
        finally:
            task.cancel()

    try:
        d = asyncio.run(scenario())
        assert not d.exists()
        assert state.store.get_checkpoint("run:train:0", "weights", "soon") is None
    finally:
        state.store.close()
