"""``save_weights_external`` end to end: PEFT adapters (LoRA runs) and Hugging Face model
directories (full fine-tunes), plain or age-encrypted to the caller's recipients, fetched through
``get_external_weights_urls`` with plain GETs, and decrypted with ``pyrage`` as the cookbook does."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import numpy as np
import pyrage
import pytest
import tinker

from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import RESULT_TIMEOUT_S, detail, gathered_logprobs, logprobs_of, raw_client, sft_batch
from tests.rl.helpers import checkpoint_dir, full_finetune_client, train_steps_on

API_KEY = "tml-rl-external"
OTHER_KEY = "tml-rl-external-other"


@pytest.fixture(scope="module")
def ext_server(make_server, tmp_path_factory):
    """Two tenants (an API keys file), so that one key's download links are out of the other's reach."""
    keys = tmp_path_factory.mktemp("ext-keys") / "api-keys.txt"
    keys.write_text(f"{API_KEY}\n{OTHER_KEY}\n")
    return make_server(api_keys_file=keys, extra_args=["--max-full-finetunes", "2"])


@pytest.fixture(scope="module")
def lora_run(ext_server, base_model):
    sc = tinker.ServiceClient(base_url=ext_server.base_url, api_key=API_KEY)
    tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=7).result(timeout=RESULT_TIMEOUT_S)
    train_steps_on(tc, sft_batch(seed=3, n_seqs=2, seq_len=12, vocab=VOCAB), 2, 1e-2)
    yield {"sc": sc, "tc": tc, "run_id": str(tc.model_id)}
    sc.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def rest(ext_server):
    return tinker.RestClient(base_url=ext_server.base_url, api_key=API_KEY)


def _ssh_key(tmp_path: Path) -> tuple[str, Path]:
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key.with_suffix(".pub").read_text().strip(), key


def _fetch_all(rest, path: str) -> dict[str, bytes]:
    """Every file of an external checkpoint, fetched as the CLI does (plain, unauthenticated GETs)."""
    urls = rest.get_external_weights_urls(path).result(timeout=RESULT_TIMEOUT_S).urls
    out = {}
    for rel, url in urls.items():
        r = httpx.get(url, timeout=30)
        assert r.status_code == 200, (rel, r.status_code, r.text[:200])
        out[rel] = r.content
    return out


@pytest.mark.e2e
def test_lora_export_encrypted_to_every_recipient(lora_run, rest, ext_server, tmp_path):
    tc = lora_run["tc"]
    identity = pyrage.x25519.Identity.generate()
    ssh_pub, ssh_key = _ssh_key(tmp_path)
    plain_path = tc.save_weights_external("plain").result(timeout=RESULT_TIMEOUT_S).path
    sealed_path = tc.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public()), ssh_pub]).result(timeout=RESULT_TIMEOUT_S).path
    assert sealed_path == f"tinker://{lora_run['run_id']}/external_weights/sealed"

    plain, sealed = _fetch_all(rest, plain_path), _fetch_all(rest, sealed_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(plain)
    assert set(sealed) == {f"{name}.age" for name in plain}
    # No plaintext at rest either: the checkpoint directory holds only the .age files.
    assert {p.name for p in checkpoint_dir(ext_server, sealed_path).iterdir()} == set(sealed)
    ssh_identity = pyrage.ssh.Identity.from_buffer(ssh_key.read_bytes())
    for name, data in plain.items():
        blob = sealed[f"{name}.age"]
        assert blob.startswith(b"age-encryption.org/v1\n") and data not in blob
        assert pyrage.decrypt(blob, [identity]) == data, name
        assert pyrage.decrypt(blob, [ssh_identity]) == data, name
        with pytest.raises(pyrage.DecryptError):
            pyrage.decrypt(blob, [pyrage.x25519.Identity.generate()])
    # The listing reports the bytes stored (the encrypted files).
    listed = {c.tinker_path: c for c in rest.list_checkpoints(lora_run["run_id"]).result().checkpoints}
    assert listed[sealed_path].size_bytes == sum(len(b) for b in sealed.values())
    assert listed[sealed_path].checkpoint_type == "external"


@pytest.mark.e2e
def test_full_finetune_export_is_a_hugging_face_model(ext_server, base_model, rest, tmp_path):
    """A full fine-tune exports a plain HF model directory; decrypted, transformers reproduces the
    server's logprobs."""
    from transformers import AutoModelForCausalLM

    sc = tinker.ServiceClient(base_url=ext_server.base_url, api_key=API_KEY)
    try:
        tc = full_finetune_client(sc, base_model)
        data = sft_batch(seed=9, n_seqs=2, seq_len=10, vocab=VOCAB)
        train_steps_on(tc, data, 2, 1e-3)
        server_lp = logprobs_of(tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
        identity = pyrage.x25519.Identity.generate()
        path = tc.save_weights_external("hf", age_encryption_recipients=[str(identity.to_public())]).result(
            timeout=RESULT_TIMEOUT_S).path
        out = tmp_path / "hf"
        out.mkdir()
        for name, blob in _fetch_all(rest, path).items():
            assert name.endswith(".age")
            (out / name.removesuffix(".age")).write_bytes(pyrage.decrypt(blob, [identity]))
        assert {"model.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype="float32")
        ours = gathered_logprobs(model, data)
        for a, b in zip(ours, server_lp):
            np.testing.assert_allclose(a, b, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype="float32")
        assert not np.allclose(gathered_logprobs(base, data)[0], ours[0], atol=1e-4)  # it did train
    finally:
        sc.close("success").result(timeout=60)


@pytest.mark.e2e
@pytest.mark.parametrize("recipients, says", [
    (["age1notakey"], "age_encryption_recipients[0] is not a valid age recipient"),
    ([""], "age_encryption_recipients[0] must be a non-empty"),
    (["AGE-SECRET-KEY-1QQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQ"],
     "age_encryption_recipients[0] is not an age recipient"),
    (["ssh-ed25519 AAAAnotbase64"], "age_encryption_recipients[0] is not a valid age recipient"),
    (["x" * 100_000], "age_encryption_recipients[0] is 100000 characters long"),
    ([None], "age_encryption_recipients"),
    ("age1abc", "age_encryption_recipients"),
])
def test_bad_recipients_are_refused_naming_the_field(lora_run, ext_server, recipients, says):
    with raw_client(ext_server.base_url, API_KEY) as http:
        r = http.post("/api/v1/save_weights_external", json={
            "model_id": lora_run["run_id"], "path": "refused", "age_encryption_recipients": recipients})
        assert r.status_code == 400, (r.status_code, r.text[:300])
        msg = detail(r)
        assert says in msg
        assert "SECRET" not in msg and "x" * 100 not in msg  # the value itself is never echoed
    assert checkpoint_dir(ext_server, f"tinker://{lora_run['run_id']}/external_weights/refused").exists() is False


@pytest.mark.e2e
def test_recipient_count_and_kind_limits(lora_run, ext_server):
    good = str(pyrage.x25519.Identity.generate().to_public())
    with raw_client(ext_server.base_url, API_KEY) as http:
        r = http.post("/api/v1/save_weights_external", json={
            "model_id": lora_run["run_id"], "path": "many", "age_encryption_recipients": [good] * 11})
        assert r.status_code == 400 and "at most 10" in detail(r)
        r = http.post("/api/v1/save_weights", json={
            "model_id": lora_run["run_id"], "path": "state", "age_encryption_recipients": [good]})
        assert r.status_code == 400 and "save_weights_external only" in detail(r)


@pytest.mark.e2e
def test_download_links_are_private_and_confined(lora_run, rest, ext_server):
    """Another key cannot list the links; a link cannot reach a file outside its checkpoint."""
    tc = lora_run["tc"]
    identity = pyrage.x25519.Identity.generate()
    path = tc.save_weights_external("confined", age_encryption_recipients=[str(identity.to_public())]).result(
        timeout=RESULT_TIMEOUT_S).path
    other = tinker.RestClient(base_url=ext_server.base_url, api_key=OTHER_KEY)
    with pytest.raises(tinker.TinkerError):
        other.get_external_weights_urls(path).result(timeout=RESULT_TIMEOUT_S)
    urls = rest.get_external_weights_urls(path).result(timeout=RESULT_TIMEOUT_S).urls
    url = urls["adapter_model.safetensors.age"]
    head, _, _ = url.rpartition("/")
    for evil in ("..%2F..%2Fweights%2Fa%2Fweights.safetensors", "%2E%2E", ".hidden", "adapter_model.safetensors",
                 "..%5C..%5Cx"):
        r = httpx.get(f"{head}/{evil}", timeout=30)
        assert r.status_code in (403, 404), (evil, r.status_code)
        assert "json" in r.headers.get("content-type", "") and not r.content.startswith(b"age-encryption.org")


@pytest.mark.e2e
def test_cli_download_of_a_full_finetune_state(ext_server, base_model, rest, tmp_path):
    """``tinker checkpoint download tinker://RUN/weights/NAME`` (create-from-state, export,
    signed URLs, delete) on a full fine-tune: the files are the run's weights, and the temporary
    export is gone afterwards."""
    import os
    import sys

    from safetensors.torch import load_file

    sc = tinker.ServiceClient(base_url=ext_server.base_url, api_key=API_KEY)
    try:
        tc = full_finetune_client(sc, base_model)
        train_steps_on(tc, sft_batch(seed=4, n_seqs=2, seq_len=10, vocab=VOCAB), 1, 1e-3)
        state_path = tc.save_state("cli").result(timeout=RESULT_TIMEOUT_S).path
    finally:
        sc.close("success").result(timeout=60)
    env = {**os.environ, "TINKER_BASE_URL": ext_server.base_url, "TINKER_API_KEY": API_KEY}
    cli = Path(sys.executable).with_name("tinker")
    r = subprocess.run([str(cli), "checkpoint", "download", state_path, "--output", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    got = tmp_path / state_path.replace("tinker://", "").replace("/", "_")
    assert {"model.safetensors", "config.json"} <= {p.name for p in got.iterdir()}
    exported = load_file(str(got / "model.safetensors"))
    saved = load_file(str(checkpoint_dir(ext_server, state_path) / "weights.safetensors"))
    assert set(exported) <= set(saved) and len(exported) > 0
    for name, t in exported.items():
        assert (t == saved[name]).all(), name
    # The CLI's temporary export (a new run's external_weights/download) was deleted.
    mine = rest.list_user_checkpoints().result(timeout=RESULT_TIMEOUT_S).checkpoints
    assert not [c for c in mine if c.checkpoint_type == "external" and c.tinker_path.endswith("/download")]
