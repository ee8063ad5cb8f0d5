"""Sampling through the unmodified ``tinker`` SDK against a real ``tinsmith serve`` process.

Snapshot isolation, stored sampler weights, the base-model sampler, 64 concurrent requests of
mixed adapters checked one by one against the same request run alone, bad input (a clear 4xx
or failed future naming the field, never a 500 or a hang) and the 0.22.2 SDK's JSON path.
Greedy decoding makes every result deterministic, so "the same" means exactly the same.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.helpers import assert_no_internal_errors
from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:DEPRECATED.*sample_async:FutureWarning")]

TIMEOUT = 60.0  # no single tiny-model request may take longer: a hang fails the test
OLD_SDK_PYTHON = Path(__file__).resolve().parents[2] / ".venv-sdk-0.22.2" / "bin" / "python"


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    # One intra-op thread: the model is tiny, and when other processes share the CPU (parallel
    # test runs) OpenMP's spinning threads make each decode step tens of times slower.
    srv = ServerProcess(qwen3_dir, tmp_path_factory.mktemp("sampling-server"), env={"OMP_NUM_THREADS": "1"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base_model(qwen3_dir) -> str:
    return str(qwen3_dir)


@pytest.fixture(scope="module")
def sc(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-sampling-tests")
    yield client
    try:
        client.close("success").result(timeout=60)
    except Exception:  # noqa: BLE001 - closing is best effort
        pass


def prompt_list(seed: int, lengths) -> list[types.ModelInput]:
    rng = np.random.default_rng(seed)
    return [types.ModelInput.from_ints(rng.integers(4, 512, n).tolist()) for n in lengths]


def greedy(max_tokens: int = 12, **kw) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def train(tc, seed: int, steps: int, lr: float) -> None:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(4):
        t = rng.integers(4, 512, 25).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                                loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * 24}))
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=lr))
        fb.result(timeout=TIMEOUT)
        op.result(timeout=TIMEOUT)


def lora(sc, base_model, seed: int):
    return sc.create_lora_training_client(base_model=base_model, rank=4, seed=seed).result(timeout=TIMEOUT)


def one_by_one(sampler, prompts, params, **kw) -> list[types.SampleResponse]:
    """Each request alone: submitted after the previous one has finished."""
    return [sampler.sample(p, 1, params, **kw).result(timeout=TIMEOUT) for p in prompts]


def seqs(responses) -> list[tuple[list[int], np.ndarray, str]]:
    return [(s.tokens, np.asarray(s.logprobs, dtype=np.float32), s.stop_reason) for r in responses for s in r.sequences]


def assert_same(a, b, *, atol: float = 0.0, what: str = "") -> None:
    sa, sb = seqs(a), seqs(b)
    assert len(sa) == len(sb)
    for i, ((ta, la, ra), (tb, lb, rb)) in enumerate(zip(sa, sb)):
        assert ta == tb and ra == rb, f"{what}: sequence {i} differs: {ta} vs {tb}"
        if atol == 0.0:
            np.testing.assert_array_equal(la, lb, err_msg=f"{what}: sequence {i}")
        else:
            np.testing.assert_allclose(la, lb, atol=atol, rtol=0, err_msg=f"{what}: sequence {i}")


def check_against_forward(tc, prompts, responses, atol: float = 1e-4) -> None:
    """Sampled (and prompt) logprobs equal the training client's forward pass over prompt + sample.

    Valid while ``tc``'s weights are those the sampler was made from.
    """
    data, expect = [], []
    for prompt, res in zip(prompts, responses):
        for seq in res.sequences:
            full = prompt.to_ints() + list(seq.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                    loss_fn_inputs={"target_tokens": full[1:]}))
            plp = res.prompt_logprobs[1:] if res.prompt_logprobs is not None else [np.nan] * (prompt.length - 1)
            expect.append(np.array([np.nan if x is None else x for x in plp] + list(seq.logprobs), dtype=np.float64))
    out = tc.forward(data, "cross_entropy").result(timeout=TIMEOUT)
    for i, (o, want) in enumerate(zip(out.loss_fn_outputs, expect)):
        got = np.asarray(o["logprobs"].to_numpy(), dtype=np.float64)
        assert len(got) == len(want)
        known = ~np.isnan(want)
        np.testing.assert_allclose(got[known], want[known], atol=atol, rtol=0, err_msg=f"datum {i}")


def max_lp_gap(a, b) -> float:
    return max(float(np.abs(la - lb).max()) if ta == tb else float("inf")
               for (ta, la, _), (tb, lb, _) in zip(seqs(a), seqs(b)))


# ------------------------------------------------------------------------------------ snapshots
def test_snapshots_are_frozen_and_stored_weights_match(sc, base_model):
    prompts = prompt_list(1, (5, 13))
    params = greedy(16, stop=[])

    tc = lora(sc, base_model, seed=1)
    fresh = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    base = sc.create_sampling_client(base_model=base_model).result(timeout=TIMEOUT)
    # An untrained adapter (B = 0) is the base model, exactly.
    assert_same(one_by_one(fresh, prompts, params), one_by_one(base, prompts, params), what="fresh adapter vs base")

    train(tc, seed=1, steps=2, lr=1e-2)
    snap1 = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    path = tc.save_weights_for_sampler("same-as-snap1").result(timeout=TIMEOUT).path
    assert path.startswith("tinker://") and "/sampler_weights/same-as-snap1" in path
    before = one_by_one(snap1, prompts, params, include_prompt_logprobs=True)
    check_against_forward(tc, prompts, before)  # the snapshot samples the adapter's own model
    assert max_lp_gap(before, one_by_one(base, prompts, params)) > 1e-3, "training should have changed the adapter"

    train(tc, seed=2, steps=4, lr=5e-2)  # a high learning rate: the live adapter moves a lot
    snap2 = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)

    after = one_by_one(snap1, prompts, params, include_prompt_logprobs=True)
    assert_same(before, after, what="old snapshot after training")
    for r0, r1 in zip(before, after):
        np.testing.assert_array_equal(np.array(r0.prompt_logprobs[1:]), np.array(r1.prompt_logprobs[1:]))
    new = one_by_one(snap2, prompts, params)
    assert max_lp_gap(before, new) > 1e-3, "a snapshot taken after training must see the new weights"

    # Both snapshots at once (their requests share decode steps): each still gives its own result.
    async def both():
        return await asyncio.gather(*[s.sample_async(p, 1, params) for p in prompts for s in (snap1, snap2)])

    mixed = asyncio.run(both())
    assert_same(mixed[0::2], before, atol=1e-5, what="snap1 sampled beside snap2")
    assert_same(mixed[1::2], new, atol=1e-5, what="snap2 sampled beside snap1")

    # Stored sampler weights: a sampler made from the tinker:// path equals the in-memory snapshot.
    stored = sc.create_sampling_client(model_path=path).result(timeout=TIMEOUT)
    assert_same(one_by_one(stored, prompts, params, include_prompt_logprobs=True), before, what="stored path vs snapshot")
    # compute_logprobs agrees with the prompt logprobs of a sample
    lps = snap1.compute_logprobs(prompts[1]).result(timeout=TIMEOUT)
    assert lps[0] is None
    np.testing.assert_allclose(np.array(lps[1:], dtype=np.float64), np.array(before[1].prompt_logprobs[1:]), atol=1e-6)


# ------------------------------------------------------------------------------------ concurrency
def test_64_concurrent_requests_of_mixed_adapters(sc, base_model):
    samplers = {"base": sc.create_sampling_client(base_model=base_model).result(timeout=TIMEOUT)}
    trainers = {}
    for i, name in enumerate(("a", "b", "c")):
        trainers[name] = tc = lora(sc, base_model, seed=10 + i)
        train(tc, seed=10 + i, steps=2, lr=2e-2)
        samplers[name] = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)

    rng = np.random.default_rng(3)
    names = list(samplers)
    configs = []  # 32 distinct requests, each sent twice below
    for i in range(32):
        prompt = types.ModelInput.from_ints(rng.integers(4, 512, int(rng.integers(1, 24))).tolist())
        params = greedy(int(rng.integers(1, 20)), stop=[] if i % 3 else None)
        configs.append((names[i % 4], prompt, 1 + (i % 5 == 0), params, i % 4 == 1))

    def submit(name, prompt, n, params, plp):
        return samplers[name].sample_async(prompt, n, params, include_prompt_logprobs=plp)

    alone = [samplers[n].sample(p, k, sp, include_prompt_logprobs=plp).result(timeout=TIMEOUT)
             for n, p, k, sp, plp in configs]

    async def all_at_once():
        return await asyncio.wait_for(asyncio.gather(*[submit(*c) for c in configs + configs]), TIMEOUT)

    together = asyncio.run(all_at_once())
    assert len(together) == 64
    ids = []
    for i, res in enumerate(together):
        ref = alone[i % 32]
        assert len(res.sequences) == configs[i % 32][2]
        assert_same([res], [ref], atol=1e-4, what=f"request {i} ({configs[i % 32][0]})")
        if configs[i % 32][4]:
            np.testing.assert_allclose(np.array(res.prompt_logprobs[1:], dtype=np.float64),
                                       np.array(ref.prompt_logprobs[1:], dtype=np.float64), atol=1e-4)
        ids += [s.sequence_id for s in res.sequences]
    assert all(isinstance(x, str) and x for x in ids)
    assert len(set(ids)) == len(ids), "sequence ids must be unique"
    # each adapter's results are that adapter's model (its training client's forward agrees)
    for name, tc in trainers.items():
        mine = [i for i, c in enumerate(configs) if c[0] == name]
        check_against_forward(tc, [configs[i][1] for i in mine], [alone[i] for i in mine])
    # the four models really differ, so a request served by the wrong one would have been caught
    probe = configs[0][1]
    firsts = {n: s.sample(probe, 1, greedy(1)).result(timeout=TIMEOUT).sequences[0].logprobs[0] for n, s in samplers.items()}
    assert len({round(float(x), 4) for x in firsts.values()}) == 4, firsts


# ------------------------------------------------------------------------------------ bad input
def test_bad_input_is_a_clear_client_error(sc, server, base_model):
    log_start = len(server.log_text())
    base = sc.create_sampling_client(base_model=base_model).result(timeout=TIMEOUT)
    (p,) = prompt_list(4, (6,))

    # rejected at submission: HTTP 400 naming the field
    for label, prompt, params, field in [
        ("empty prompt", types.ModelInput.from_ints([]), greedy(4), "prompt"),
        ("max_tokens=0", p, greedy(0), "max_tokens"),
        ("max_tokens<0", p, greedy(-3), "max_tokens"),
        ("top_p=0", p, types.SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
        ("top_p=1.5", p, types.SamplingParams(max_tokens=4, top_p=1.5), "top_p"),
    ]:
        with pytest.raises(tinker.APIStatusError) as ei:
            base.sample(prompt, 1, params).result(timeout=TIMEOUT)
        assert 400 <= ei.value.status_code < 500, (label, ei.value.status_code)
        assert field in str(ei.value), (label, str(ei.value))

    # accepted, then refused by the sampler: a failed future naming the field (not a hang)
    for label, prompt, n, params, field in [
        ("beyond the context", p, 1, greedy(4096), "max_tokens"),
        ("token id >= vocab", types.ModelInput.from_ints([5, 600, 7]), 1, greedy(4), "prompt"),
        ("num_samples above the row limit", p, 100_000, greedy(2), "num_samples"),
    ]:
        with pytest.raises((tinker.RequestFailedError, tinker.APIStatusError)) as ei:
            base.sample(prompt, n, params).result(timeout=TIMEOUT)
        status = getattr(ei.value, "status_code", 400)
        assert 400 <= status < 500, (label, status)
        assert field in str(ei.value), (label, str(ei.value))

    # unknown sampler / weights
    with pytest.raises(tinker.APIStatusError) as ei:
        sc.create_sampling_client(model_path="tinker://no-such-run/sampler_weights/none").result(timeout=TIMEOUT)
    assert ei.value.status_code == 404 and "no-such-run" in str(ei.value)
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": "tml-sampling-tests"}, timeout=TIMEOUT) as http:
        body = {"sampling_session_id": "no-such-sampler", "seq_id": 0, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                "sampling_params": {"max_tokens": 2}, "type": "sample"}
        r = http.post("/api/v1/asample", json=body)
        assert r.status_code == 404 and "sampling_session_id" in r.text, r.text
        r = http.get("/api/v1/samplers/no-such-sampler")
        assert r.status_code == 404 and "no-such-sampler" in r.text, r.text
        r = http.post("/api/v1/asample", json={**body, "sampling_session_id": None, "base_model": base_model,
                                               "sampling_params": {"max_tokens": 2, "top_p": 2}})
        assert r.status_code == 400 and "top_p" in r.text, r.text

    # the server is fine afterwards and never answered with an internal error
    ok = base.sample(p, 1, greedy(4)).result(timeout=TIMEOUT)
    assert len(ok.sequences[0].tokens) >= 1
    assert_no_internal_errors(server.log_text()[log_start:])


# ------------------------------------------------------------------------------------ SDK 0.22.2
OLD_SDK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import tinker
    from tinker import types
    url, base_model, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sc = tinker.ServiceClient(base_url=url, api_key="tml-sampling-tests")
    s = sc.create_sampling_client(base_model=base_model)
    r = s.sample(types.ModelInput.from_ints(prompt), 2,
                 types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result(timeout=60)
    print(json.dumps({"version": tinker.__version__,
                      "sequences": [{"tokens": q.tokens, "logprobs": q.logprobs, "stop_reason": q.stop_reason}
                                    for q in r.sequences]}))
    # The 0.22.2 SDK's background event-loop thread can abort the interpreter at shutdown
    # (SIGABRT after the result is out, nothing on stderr): leave without finalisation.
    sys.stdout.flush()
    os._exit(0)
""")


def test_sdk_0_22_2_samples_through_the_json_path(sc, server, base_model):
    if not OLD_SDK_PYTHON.exists():
        pytest.skip(f"tinker 0.22.2 interpreter not found at {OLD_SDK_PYTHON}")
    prompt = [11, 22, 33, 44, 55]
    proc = subprocess.run([str(OLD_SDK_PYTHON), "-c", OLD_SDK_SCRIPT, server.base_url, base_model, json.dumps(prompt)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    old = json.loads(proc.stdout.strip().splitlines()[-1])
    assert old["version"] == "0.22.2"
    base = sc.create_sampling_client(base_model=base_model).result(timeout=TIMEOUT)
    new = base.sample(types.ModelInput.from_ints(prompt), 1, greedy(8, stop=[])).result(timeout=TIMEOUT).sequences[0]
    assert len(old["sequences"]) == 2
    for q in old["sequences"]:
        assert q["tokens"] == new.tokens and q["stop_reason"] == "length"
        np.testing.assert_allclose(q["logprobs"], new.logprobs, atol=1e-6)

    # the result encoding follows the SDK generation that submitted the request
    body = {"base_model": base_model, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": 3, "temperature": 0.0}, "type": "sample"}
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": "tml-sampling-tests"}, timeout=TIMEOUT) as http:
        for version, kind in (("0.22.2", "application/json"), ("0.38.0", "application/x-protobuf")):
            r = http.post("/api/v1/asample", json=body, headers={"X-Stainless-Package-Version": version})
            assert r.status_code == 200, r.text
            rid = r.json()["request_id"]
            for _ in range(600):
                res = http.post("/api/v1/retrieve_future", json={"request_id": rid})
                if not ("json" in res.headers["content-type"] and res.json().get("type") == "try_again"):
                    break
            assert res.status_code == 200 and res.headers["content-type"].startswith(kind), (version, res.headers)
            if kind == "application/json":
                assert res.json()["sequences"][0]["tokens"] == new.tokens[:3]


# ------------------------------------------------------------------------------------ prompt scoring
def test_target_prompt_logprobs_and_prompt_alt_tokens(sc, base_model):
    """Requested ids scored at prompt positions (dense and sparse CSR), and k draws per position.

    The reference is the prompt logprobs of the same request: row ``i`` of the answer belongs to
    prompt position ``i + 1``, and ``prompt[i + 1]`` asked as a target gets exactly its logprob.
    """
    import torch

    sampler = sc.create_sampling_client(base_model=base_model).result(timeout=TIMEOUT)
    prompt = prompt_list(71, (9,))[0]
    ids = prompt.to_ints()
    P = len(ids)
    full = sampler.sample(prompt, 1, greedy(1), include_prompt_logprobs=True, topk_prompt_logprobs=3
                          ).result(timeout=TIMEOUT)
    # column 0: the real next token; column 1: the top-1 token; column 2: nothing (-1) but row 3,
    # which asks for the third most likely token at position 4
    asked = np.full((P - 1, 3), -1, dtype=np.int64)
    asked[:, 0] = ids[1:]
    asked[:, 1] = [full.topk_prompt_logprobs[i + 1][0][0] for i in range(P - 1)]
    third_id, third_lp = full.topk_prompt_logprobs[4][2]
    asked[3, 2] = third_id
    dense = sampler.sample(prompt, 1, greedy(1),
                           target_prompt_logprobs=types.TensorData.from_torch(torch.tensor(asked)),
                           ).result(timeout=TIMEOUT)
    got = np.asarray(dense.target_prompt_logprobs.data, dtype=np.float32).reshape(P - 1, 3)
    assert dense.target_prompt_logprobs.shape == [P - 1, 3]
    np.testing.assert_allclose(got[:, 0], full.prompt_logprobs[1:], atol=1e-5)
    np.testing.assert_allclose(got[:, 1], [full.topk_prompt_logprobs[i + 1][0][1] for i in range(P - 1)], atol=1e-5)
    assert (got[np.arange(P - 1) != 3, 2] == 0.0).all()  # 0.0 where -1 was asked
    assert abs(got[3, 2] - third_lp) < 1e-5

    # sparse CSR in (wide and mostly -1, so the SDK sends CSR), the same layout out
    wide = np.full((P - 1, 20), -1, dtype=np.int64)
    wide[:, 0] = ids[1:]
    wide[3, 7] = third_id
    td = types.TensorData.from_torch_sparse(torch.tensor(wide), pad_value=-1)
    assert td.sparse_crow_indices is not None  # really sent sparse
    out = sampler.sample(prompt, 1, greedy(1), target_prompt_logprobs=td).result(timeout=TIMEOUT).target_prompt_logprobs
    assert out.shape == [P - 1, 20]
    assert out.sparse_crow_indices == td.sparse_crow_indices and out.sparse_col_indices == td.sparse_col_indices
    want = np.concatenate([[got[i, 0]] + ([got[3, 2]] if i == 3 else []) for i in range(P - 1)])
    np.testing.assert_allclose(out.data, want, atol=1e-6)

    # prompt_alt_tokens: k draws per position, model logprobs, reproducible with a seed
    params = types.SamplingParams(max_tokens=1, temperature=1.0, seed=11)
    a = sampler.sample(prompt, 1, params, prompt_alt_tokens_k=4).result(timeout=TIMEOUT)
    b = sampler.sample(prompt, 1, params, prompt_alt_tokens_k=4).result(timeout=TIMEOUT)
    toks = np.asarray(a.prompt_alt_tokens.tokens.data).reshape(P - 1, 4)
    lps = np.asarray(a.prompt_alt_tokens.logprobs.data, dtype=np.float32).reshape(P - 1, 4)
    assert a.prompt_alt_tokens.tokens.shape == [P - 1, 4]
    assert toks.tolist() == np.asarray(b.prompt_alt_tokens.tokens.data).reshape(P - 1, 4).tolist()
    # each draw's logprob is the model's: score the drawn ids as targets (checked above)
    scored = sampler.sample(prompt, 1, greedy(1), target_prompt_logprobs=types.TensorData.from_torch(
        torch.tensor(toks))).result(timeout=TIMEOUT)
    np.testing.assert_allclose(lps.ravel(), scored.target_prompt_logprobs.data, atol=1e-5)
    assert len(set(toks.ravel().tolist())) > P - 1  # independent draws, not one token repeated
    greedy_alt = sampler.sample(prompt, 1, greedy(1), prompt_alt_tokens_k=2).result(timeout=TIMEOUT)
    top1 = [full.topk_prompt_logprobs[i + 1][0][0] for i in range(P - 1)]
    assert np.asarray(greedy_alt.prompt_alt_tokens.tokens.data).reshape(P - 1, 2).tolist() == [[t, t] for t in top1]


def test_target_prompt_logprobs_bad_input_names_the_field(server, base_model):
    log_start = len(server.log_text())
    sampler_body = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                    "sampling_params": {"max_tokens": 1}, "base_model": base_model, "type": "sample"}
    cases = [
        ({"data": [5, 6, 7], "dtype": "int64", "shape": [3, 1]}, "len(prompt) - 1 = 2"),
        ({"data": [-1, -1], "dtype": "int64", "shape": [2, 1]}, "names no token id"),
        ({"data": [1.5, 2.0], "dtype": "float32", "shape": [2, 1]}, "int64"),
        ({"data": [999999, 1], "dtype": "int64", "shape": [2, 1]}, "outside"),
    ]
    for bad, needle in cases:
        r = httpx.post(server.base_url + "/api/v1/asample", json={**sampler_body, "target_prompt_logprobs": bad},
                       headers={"X-API-Key": "tml-sampling-tests"}, timeout=TIMEOUT)
        body = r.text
        if r.status_code == 200:  # accepted: the failure arrives with the future
            fut = r.json()["request_id"]
            res = httpx.post(server.base_url + "/api/v1/retrieve_future", json={"request_id": fut},
                             headers={"X-API-Key": "tml-sampling-tests"}, timeout=TIMEOUT)
            body = res.text
            assert "target_prompt_logprobs" in body and needle in body, body
        else:
            assert r.status_code == 400 and "target_prompt_logprobs" in body and needle in body, body
    assert_no_internal_errors(server.log_text()[log_start:])
