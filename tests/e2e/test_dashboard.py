"""The web dashboard in a real headless browser, and the JSON behind it, on one shared server.

Three keys: A and B train with the real SDK; ADMIN (marked ``admin`` in the keys file) reads
everything. Chromium is found on the machine, or installed with apt-get when the tests run as
root; otherwise the browser tests are skipped with the reason (the JSON tests still run).

Screenshots go under the test's tmp dir; set TINSMITH_DASHBOARD_SCREENSHOTS=DIR to also write
them there (docs/images/ holds the committed ones).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, assert_no_internal_errors, sft_batch, train_steps

KEY_A = "tml-dash-tenant-a"
KEY_B = "tml-dash-tenant-b"
KEY_ADMIN = "tml-dash-admin"
XSS = '<img src=x onerror="window.__xss=1">'
STEPS = 3


# ------------------------------------------------------------------------------ server and runs
@pytest.fixture(scope="module")
def dash_server(make_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("dash-keys") / "api-keys.txt"
    keys.write_text(f"{KEY_A}\n{KEY_B}  # second tenant\n{KEY_ADMIN} admin  # operators\n")
    return make_server(api_keys_file=keys)


@pytest.fixture(scope="module")
def runs(dash_server, base_model) -> Iterator[dict]:
    """A trains 3 steps and saves a checkpoint; B trains 1 step and freezes a sampler snapshot.
    Their run ids; the sessions stay open (heartbeating) until the module ends, so the runs stay
    active and the training clients stay at hand (``ids['clients']``)."""
    ids, clients = {}, []
    try:
        for key, steps in ((KEY_A, STEPS), (KEY_B, 1)):
            sc = tinker.ServiceClient(base_url=dash_server.base_url, api_key=key)
            clients.append(sc)
            tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=0,
                                                user_metadata={"note": XSS}).result(timeout=RESULT_TIMEOUT_S)
            train_steps(tc, sft_batch(seed=1, n_seqs=2, seq_len=12, vocab=VOCAB), steps)
            if key == KEY_A:
                tc.save_state("ckpt-1").result(timeout=RESULT_TIMEOUT_S)
                tc.save_weights_for_sampler("to-delete").result(timeout=RESULT_TIMEOUT_S)
            else:
                ids["sampler_b"] = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
            ids[key] = tc.model_id
            ids.setdefault("clients", {})[key] = tc
        yield ids
    finally:
        for sc in clients:
            try:
                sc.close("success").result(timeout=60)
            except Exception:  # noqa: BLE001 - the server may already be gone
                pass


def _get(server, path: str, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"X-API-Key": key}
    return httpx.get(server.base_url + path, headers=headers, timeout=30)


# ------------------------------------------------------------------------------ JSON
def test_summary_shows_a_key_its_own_runs_and_an_admin_every_run(dash_server, runs):
    a, b = runs[KEY_A], runs[KEY_B]
    mine = _get(dash_server, "/dashboard/api/summary", KEY_A).json()
    assert mine["caller"]["admin"] is False
    assert [r["model_id"] for r in mine["runs"]] == [a]
    run = mine["runs"][0]
    assert (run["lora_rank"], run["steps"], run["status"]) == (4, STEPS, "active")
    assert all(q["owner"] == mine["caller"]["owner"] for q in mine["queue"])
    assert mine["health"]["process_rss_bytes"] > 0
    assert mine["throughput"]["tokens_trained"] > 0  # trained within the last minute

    admin = _get(dash_server, "/dashboard/api/summary", KEY_ADMIN).json()
    assert admin["caller"]["admin"] is True
    owners = {r["model_id"]: r["owner"] for r in admin["runs"]}
    assert set(owners) == {a, b} and owners[a] != owners[b]


def test_queue_and_sampler_snapshots_of_other_keys_stay_hidden(dash_server, runs):
    """B's in-memory snapshot and B's queued requests appear to the admin, never to A."""
    a_owner = _get(dash_server, "/dashboard/api/summary", KEY_A).json()["caller"]["owner"]
    tc_b = runs["clients"][KEY_B]
    data = sft_batch(seed=2, n_seqs=4, seq_len=48, vocab=VOCAB)
    futures = [tc_b.forward_backward(data, "cross_entropy") for _ in range(6)]
    seen_b_queued = False
    for _ in range(200):
        admin = _get(dash_server, "/dashboard/api/summary", KEY_ADMIN).json()
        mine = _get(dash_server, "/dashboard/api/summary", KEY_A).json()
        assert all(q["owner"] == a_owner for q in mine["queue"])
        assert all(s["owner"] == a_owner for s in mine["samplers"])
        b_queue = [q for q in admin["queue"] if q["model_id"] == runs[KEY_B]]
        if b_queue:
            seen_b_queued = True
            assert b_queue[0]["kind"] == "forward_backward" and "payload" not in b_queue[0]
            break
    for f in futures:
        f.result(timeout=RESULT_TIMEOUT_S)
    assert seen_b_queued, "the admin never saw B's requests in the queue"
    b_owner = {r["model_id"]: r["owner"] for r in admin["runs"]}[runs[KEY_B]]
    assert sorted(s["owner"] for s in admin["samplers"]) == sorted([a_owner, b_owner])
    [own] = _get(dash_server, "/dashboard/api/summary", KEY_A).json()["samplers"]
    assert own["key"].endswith("/sampler_weights/to-delete") and own["stored"] is True


def test_sampled_tokens_count_in_the_throughput(dash_server, runs):
    before = _get(dash_server, "/dashboard/api/summary", KEY_A).json()["throughput"]["tokens_sampled"]
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)
    runs["sampler_b"].sample(types.ModelInput.from_ints([1, 2, 3]), 2, params).result(timeout=RESULT_TIMEOUT_S)
    after = _get(dash_server, "/dashboard/api/summary", KEY_A).json()["throughput"]
    assert after["tokens_sampled"] - before == 10  # 2 samples of 5 tokens, within the last minute
    assert after["sample_tokens_per_s"] == after["tokens_sampled"] / after["window_s"]


def test_run_detail_has_the_loss_per_step_and_checkpoints_for_its_owner_only(dash_server, runs):
    a, b = runs[KEY_A], runs[KEY_B]
    d = _get(dash_server, f"/dashboard/api/runs/{a}", KEY_A).json()
    loss = d["metrics"]["loss:sum"]
    assert [step for step, _ in loss] == list(range(STEPS))
    assert loss[-1][1] < loss[0][1]  # the SDK trained it: the loss went down
    cks = {c["name"]: c for c in d["checkpoints"]}
    assert set(cks) == {"ckpt-1", "to-delete"}
    ck = cks["ckpt-1"]
    assert (ck["kind"], ck["deletable"], ck["expires_at"]) == ("weights", True, None) and ck["size_bytes"] > 0
    assert cks["to-delete"]["kind"] == "sampler_weights"

    # Another key: not found, whether it asks for the run, its metrics or its files.
    for path in (f"/dashboard/api/runs/{a}", f"/dashboard/api/runs/{a}/checkpoints/weights/ckpt-1/files"):
        r = _get(dash_server, path, KEY_B)
        assert r.status_code == 404, r.text
        assert a not in r.text or "not found" in r.text
    assert _get(dash_server, f"/dashboard/api/runs/{b}", KEY_B).status_code == 200
    # The admin reads it, but downloads and deletes stay with the owner (as in the API).
    admin_view = _get(dash_server, f"/dashboard/api/runs/{a}", KEY_ADMIN).json()
    assert len(admin_view["checkpoints"]) == 2
    assert not any(c["deletable"] or c["downloadable"] for c in admin_view["checkpoints"])
    assert _get(dash_server, f"/dashboard/api/runs/{a}/checkpoints/weights/ckpt-1/files", KEY_ADMIN).status_code == 404
    # No key, or a wrong one: refused.
    assert _get(dash_server, "/dashboard/api/summary", None).status_code == 401
    assert _get(dash_server, "/dashboard/api/summary", "tml-not-listed").status_code == 401


def test_download_links_of_a_training_checkpoint_work_and_are_bound_to_it(dash_server, runs):
    a = runs[KEY_A]
    files = _get(dash_server, f"/dashboard/api/runs/{a}/checkpoints/weights/ckpt-1/files", KEY_A).json()["urls"]
    assert files
    name, url = next(iter(files.items()))
    got = httpx.get(url, timeout=30)
    assert got.status_code == 200 and len(got.content) > 0
    # The same signature does not open another kind's files.
    forged = url.replace("/weights/", "/sampler_weights/")
    assert httpx.get(forged, timeout=30).status_code in (403, 404)


def test_status_command_prints_the_summary(dash_server, runs):
    env = {**os.environ, "TINKER_API_KEY": KEY_A, "TINKER_BASE_URL": dash_server.base_url}
    out = subprocess.run([sys.executable, "-m", "tinsmith.cli", "status"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert runs[KEY_A] in out.stdout and runs[KEY_B] not in out.stdout
    assert "training runs (1)" in out.stdout and "tokens trained" in out.stdout
    admin = subprocess.run([sys.executable, "-m", "tinsmith.cli", "status", "--api-key", KEY_ADMIN, "--base-url",
                            dash_server.base_url], capture_output=True, text=True, timeout=60)
    assert admin.returncode == 0 and runs[KEY_B] in admin.stdout and "admin" in admin.stdout
    bad = subprocess.run([sys.executable, "-m", "tinsmith.cli", "status", "--api-key", "tml-nope", "--base-url",
                          dash_server.base_url], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "401" in bad.stderr


# ------------------------------------------------------------------------------ browser
def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _install_chromium() -> str:
    """Debian's chromium via apt-get (as root only, bounded in time); the reason when it cannot."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "no chromium on PATH, and not root with apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"], env=env,
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            r = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"], env=env,
                               capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "installing chromium with apt-get timed out"
    return "" if r.returncode == 0 else f"apt-get install chromium failed: {r.stderr.strip()[-300:]}"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    path = _find_chromium()
    if path is None:
        reason = _install_chromium()
        path = _find_chromium()
        if path is None:
            pytest.skip(f"no headless browser for the dashboard tests: {reason}")
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        except Exception as e:  # noqa: BLE001 - any launch failure means "no usable browser here"
            pytest.skip(f"cannot start {path}: {e}")
        yield b
        b.close()


@pytest.fixture
def page(browser, dash_server):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    pg = context.new_page()
    pg.problems = []  # console errors (a CSP violation shows up here) and page errors
    pg.on("console", lambda m: pg.problems.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: pg.problems.append(str(e)))
    yield pg
    context.close()


def _screenshot(pg, tmp_path: Path, name: str) -> None:
    pg.screenshot(path=str(tmp_path / name), full_page=True)
    keep = os.environ.get("TINSMITH_DASHBOARD_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(Path(keep) / name), full_page=True)


def _wait_until(check, timeout_s: float = 15.0) -> None:
    """Poll from the test side (the page's CSP forbids the eval that wait_for_function uses)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the page did not update in time"
        time.sleep(0.2)


def _login(pg, server, key: str) -> None:
    response = pg.goto(server.base_url + "/dashboard")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    pg.fill("#api-key", key)
    pg.click("#login-form button[type=submit]")
    pg.wait_for_selector("#runs tbody tr[data-run-id]")


def test_browser_login_shows_own_run_and_its_loss_chart(page, dash_server, runs, tmp_path):
    a, b = runs[KEY_A], runs[KEY_B]
    page.goto(dash_server.base_url + "/dashboard")
    page.fill("#api-key", "tml-not-listed")
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#login-error:has-text('not accepted')")
    page.problems.clear()  # the browser logs the refused key's 401 as an error: expected here

    _login(page, dash_server, KEY_A)
    run_ids = page.locator("#runs tbody tr[data-run-id]").evaluate_all("rows => rows.map(r => r.dataset.runId)")
    assert run_ids == [a]  # B's run is not there
    assert b not in page.content()
    assert not page.locator("#runs th.owner-col").is_visible()  # no owner column for a plain key

    page.click(f"#runs a:text-is('{a}')")
    chart = page.wait_for_selector("#charts svg[data-metric='loss:sum'] polyline")
    assert len(chart.get_attribute("points").split()) == STEPS
    page.wait_for_selector("#checkpoints tbody tr[data-checkpoint]")
    assert "ckpt-1" in page.inner_text("#checkpoints")
    assert XSS in page.inner_text("#run-info")  # user metadata shown as text, never run
    assert page.evaluate("window.__xss") is None

    # Live: one more step through the SDK shows up without reloading the page.
    train_steps(runs["clients"][KEY_A], sft_batch(seed=1, n_seqs=2, seq_len=12, vocab=VOCAB), 1)
    _wait_until(lambda: len(page.get_attribute("#charts svg[data-metric='loss:sum'] polyline", "points").split())
                == STEPS + 1)

    # Download: signed links to the checkpoint's files. Delete: through the API's own route.
    page.click("#checkpoints tr[data-checkpoint$='/weights/ckpt-1'] button:text-is('Download')")
    link = page.wait_for_selector("#downloads a[download]")
    assert httpx.get(link.get_attribute("href"), timeout=30).status_code == 200
    page.once("dialog", lambda d: d.accept())
    page.click("#checkpoints tr[data-checkpoint$='/sampler_weights/to-delete'] button:text-is('Delete')")
    page.wait_for_selector("#checkpoints tr[data-checkpoint$='/sampler_weights/to-delete']", state="detached")
    names = [c["name"] for c in _get(dash_server, f"/dashboard/api/runs/{a}", KEY_A).json()["checkpoints"]]
    assert names == ["ckpt-1"]
    _screenshot(page, tmp_path, "dashboard-run.png")
    assert page.problems == []


def test_browser_admin_sees_every_run_with_its_owner(page, dash_server, runs, tmp_path):
    _login(page, dash_server, KEY_ADMIN)
    _wait_until(lambda: page.locator("#runs tbody tr[data-run-id]").count() == 2)
    assert page.locator("#runs th.owner-col").is_visible()
    assert "admin" in page.inner_text("#who")
    _screenshot(page, tmp_path, "dashboard-admin.png")
    assert page.problems == []
    assert_no_internal_errors(dash_server.log_text())
