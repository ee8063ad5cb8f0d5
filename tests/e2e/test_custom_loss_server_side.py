"""Server-side custom losses through the unmodified SDK: ``create_custom_loss`` uploads the
traced loss (the server advertises ``custom_loss_server_side``) and ``forward_backward_custom``
runs it on the server in one forward/backward.

The reference is the SDK's own client-side path with the very same traced loss (the handle
without its ``loss_id``): values, metrics, logprobs, and the weights after an optimizer step
must agree. The step uses Adam with a large ``eps``, which makes the update proportional to the
gradient (``lr * g / (|g| + eps)``), so a wrong gradient, even a rescaled one, shows.
"""

from __future__ import annotations

import dataclasses
import re

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.custom_losses.losses import LOSSES
from tests.e2e.conftest import VOCAB
from tests.e2e.helpers import (
    RESULT_TIMEOUT_S,
    assert_no_internal_errors,
    logprobs_of,
    lora_client,
    raw_client,
    train_steps,
)

pytestmark = pytest.mark.e2e

LINEAR_ADAM = types.AdamParams(learning_rate=5e-2, eps=1.0)
TOPK = 3


def f32(values) -> types.TensorData:
    return types.TensorData.from_numpy(np.asarray(values, dtype=np.float32))


def make_data(name: str, seed: int) -> list[types.Datum]:
    """Two or three datums of different lengths carrying the inputs loss ``name`` reads."""
    rng = np.random.default_rng(seed)
    data = []
    for n in (6, 9, 4)[: 2 if name == "dpo_style" else 3]:
        tokens = rng.integers(0, VOCAB, n + 1).tolist()
        inputs: dict = {"target_tokens": tokens[1:]}
        if name == "weighted_nll":
            inputs["weights"] = f32(rng.random(n))
        elif name == "ppo_clipped":
            inputs["sampler_logprobs"] = f32(-rng.random(n) * 6 - 1)
            inputs["advantages"] = f32(rng.normal(size=n))
        elif name == "dpo_style":
            inputs["ref_logprobs"] = f32(-rng.random(n) * 6 - 1)
            inputs["mask"] = f32((np.arange(n) >= 2).astype(np.float32))
            inputs["sign"] = types.TensorData(data=[1.0 if len(data) == 0 else -1.0], dtype="float32", shape=[])
        elif name == "topk_distill":
            targets = rng.integers(0, VOCAB, (n, TOPK))
            inputs["target_tokens"] = types.TensorData.from_numpy(targets.astype(np.int64))
            probs = rng.random((n, TOPK))
            inputs["teacher_probs"] = f32(probs / probs.sum(1, keepdims=True))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


def step_and_read(tc: tinker.TrainingClient, data, loss) -> tuple[types.ForwardBackwardOutput, list[np.ndarray]]:
    out = tc.forward_backward_custom(data, loss).result(timeout=RESULT_TIMEOUT_S)
    tc.optim_step(LINEAR_ADAM).result(timeout=RESULT_TIMEOUT_S)
    fwd_data = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
                for d in data]
    return out, logprobs_of(tc.forward(fwd_data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_server_runs_the_sdk_loss_exactly_as_the_client_side_path(sc, base_model, name):
    fn, ranks = LOSSES[name]
    handle = sc.create_custom_loss(fn, ranks).result(timeout=RESULT_TIMEOUT_S)
    assert handle.loss_id is not None, "the server advertises custom_loss_server_side, so the SDK uploads"
    data = make_data(name, seed=7)

    seed = 40 + sorted(LOSSES).index(name)
    server_tc, client_tc = lora_client(sc, base_model, rank=4, seed=seed), lora_client(sc, base_model, rank=4, seed=seed)
    start = logprobs_of(server_tc.forward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S))
    on_server, after_server = step_and_read(server_tc, data, handle)
    on_client, after_client = step_and_read(client_tc, data, dataclasses.replace(handle, loss_id=None))

    assert on_server.metrics["loss:sum"] == pytest.approx(on_client.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    for key in on_client.metrics:
        if key.startswith("custom/"):
            assert on_server.metrics[key] == pytest.approx(on_client.metrics[key], rel=1e-5, abs=1e-6), key
    assert {k for k in on_server.metrics if k.startswith("custom/")} == {
        k for k in on_client.metrics if k.startswith("custom/")}
    for a, b in zip(logprobs_of(on_server), logprobs_of(on_client), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the gradients agree: the same step moved both copies the same way, and it did move them
    for a, b in zip(after_server, after_client, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    assert max(float(np.abs(a - s).max()) for a, s in zip(after_server, start)) > 1e-3


def test_loss_sum_is_the_losses_value_on_the_returned_logprobs(sc, base_model):
    """An independent reference: the loss computed in the test from the logprobs the server returned."""
    fn, ranks = LOSSES["ppo_clipped"]
    handle = sc.create_custom_loss(fn, ranks).result(timeout=RESULT_TIMEOUT_S)
    data = make_data("ppo_clipped", seed=9)
    tc = lora_client(sc, base_model, rank=4, seed=3)
    out = tc.forward_backward_custom(data, handle).result(timeout=RESULT_TIMEOUT_S)
    expected = 0.0
    for d, lp in zip(data, logprobs_of(out)):
        ratio = np.exp(lp - d.loss_fn_inputs["sampler_logprobs"].to_numpy())
        adv = d.loss_fn_inputs["advantages"].to_numpy()
        expected += -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).sum()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert "surrogate_loss:sum" not in out.metrics  # one server-side pass, no client surrogate


def test_forward_only_and_wrong_inputs(sc, base_model):
    fn, ranks = LOSSES["weighted_nll"]
    handle = sc.create_custom_loss(fn, ranks).result(timeout=RESULT_TIMEOUT_S)
    tc = lora_client(sc, base_model, rank=4, seed=5)
    data = make_data("weighted_nll", seed=2)
    ran = tc.forward(data, "custom", {"loss_id": handle.loss_id}).result(timeout=RESULT_TIMEOUT_S)
    assert ran.metrics["loss:sum"] < 0 or ran.metrics["loss:sum"] > 0
    # a rank the loss did not declare: the server names the datum and key (the SDK checks this
    # too, so send it around the SDK's check through plain forward_backward)
    bad = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"],
        "weights": f32(np.ones((len(d.loss_fn_inputs["target_tokens"].data), 2)))}) for d in data]
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].loss_fn_inputs\['weights'\] has rank 2"):
        tc.forward_backward(bad, "custom", {"loss_id": handle.loss_id}).result(timeout=RESULT_TIMEOUT_S)
    with pytest.raises(tinker.NotFoundError, match="custom loss 'no-such-loss' not found"):
        tc.forward_backward(data, "custom", {"loss_id": "no-such-loss"}).result(timeout=RESULT_TIMEOUT_S)


def test_a_loss_belongs_to_the_session_that_created_it(service_client, base_model):
    owner, other = service_client(), service_client()
    fn, ranks = LOSSES["weighted_nll"]
    handle = owner.create_custom_loss(fn, ranks).result(timeout=RESULT_TIMEOUT_S)
    tc = lora_client(other, base_model, rank=4, seed=1)
    with pytest.raises(tinker.BadRequestError, match="can only use losses its own session created"):
        tc.forward_backward(make_data("weighted_nll", 1), "custom", {"loss_id": handle.loss_id}).result(
            timeout=RESULT_TIMEOUT_S)


# ------------------------------------------------------------------------------------ hostile input
def uses_empty(logprobs):
    """The SDK accepts any torch function; the server does not run torch.empty (uninitialised memory)."""
    return (logprobs * torch_empty_like(logprobs)).sum(), {}


def torch_empty_like(x):
    import torch

    return torch.empty_like(x)


def test_a_disallowed_op_from_the_sdk_is_answered_400_naming_it(sc):
    with pytest.raises(tinker.BadRequestError, match="torch.empty_like"):
        sc.create_custom_loss(uses_empty, {"logprobs": 1}).result(timeout=RESULT_TIMEOUT_S)


def _node(name, target, *args, op="call_function"):
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


def _upload(http: httpx.Client, session_id: str, seq: int, *calls, output="x") -> httpx.Response:
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}, *calls,
             {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": output}, {"dict": {}}]}], "kwargs": {}}]
    return http.post("/api/v1/create_custom_loss", json={
        "session_id": session_id, "custom_loss_seq_id": seq, "name": "hostile",
        "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"format": 1, "nodes": nodes},
        "type": "create_custom_loss"})


LP = {"ref": "logprobs"}
HOSTILE = [
    ("os.system", [_node("x", "os.system", "echo pwned")]),
    ("builtins.__import__", [_node("x", "builtins.__import__", "subprocess")]),
    ("getattr of '__class__'", [_node("x", "getattr", LP, "__class__")]),
    ("call_method 'item'", [_node("x", "item", LP, op="call_method")]),
    ("op 'get_attr'", [{"op": "get_attr", "name": "x", "target": "_tensor_constant0", "args": [], "kwargs": {}}]),
    ("not an earlier node", [_node("x", "torch.exp", {"ref": "x"})]),
    ("{'pickle': 'gASVAAAA'} is not allowed", [_node("x", "torch.exp", {"pickle": "gASVAAAA"})]),
    ("nest deeper", [_node("x", "torch.stack", [[[[[[LP]]]]]])]),
    ("nodes", [_node(f"n{i}", "torch.exp", LP) for i in range(2000)]),
]


@pytest.mark.parametrize("match, calls", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_graphs_are_refused_at_upload_naming_the_op(server, sc, match, calls):
    with raw_client(server.base_url) as http:
        r = _upload(http, sc.holder.get_session_id(), 1000 + HOSTILE.index((match, calls)), *calls,
                    output=calls[0]["name"])
    assert r.status_code == 400, r.text
    assert match in r.text


RUNTIME_HOSTILE = [
    ("1000000000000 elements", [_node("x", "torch.ones", 10 ** 12)]),
    ("above this server's limit", [_node("v", "view", LP, -1, 1, op="call_method"),
                                   _node("x", "expand", {"ref": "v"}, -1, 1 << 40, op="call_method")]),
    ("power", [_node("n", "operator.pow", 10, 10 ** 9), _node("x", "torch.mul", LP, {"ref": "n"})]),
    ("must return a scalar", [_node("x", "torch.exp", LP)]),
    ("does not depend on logprobs", [_node("x", "torch.zeros", {"tuple": []})]),
    ("not on a tensor", [_node("x", "sum", 3, op="call_method")]),
]


@pytest.mark.parametrize("match, calls", RUNTIME_HOSTILE, ids=[h[0] for h in RUNTIME_HOSTILE])
def test_hostile_losses_fail_alone_and_other_tenants_keep_training(server, sc, service_client, base_model,
                                                                 match, calls):
    with raw_client(server.base_url) as http:
        r = _upload(http, sc.holder.get_session_id(), 2000 + RUNTIME_HOSTILE.index((match, calls)), *calls,
                    output=calls[-1]["name"])
        assert r.status_code == 200, r.text
        loss_id = http.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}).json()["loss_id"]
    attacker = lora_client(sc, base_model, rank=4, seed=2)
    neighbour = lora_client(service_client(), base_model, rank=4, seed=2)
    data = make_data("weighted_nll", seed=4)
    log_start = len(server.log_text())
    hostile = attacker.forward_backward(data, "custom", {"loss_id": loss_id})
    honest = train_steps(neighbour, data, 2)
    with pytest.raises(tinker.RequestFailedError, match=match):
        hostile.result(timeout=RESULT_TIMEOUT_S)
    assert honest[1] < honest[0]
    # the attacker's own run is intact: it trains normally afterwards
    assert len(train_steps(attacker, data, 1)) == 1
    assert_no_internal_errors(server.log_text()[log_start:])


# ------------------------------------------------------------------------------------ bad input
def _body(sid: str, **over) -> dict:
    body = {"session_id": sid, "custom_loss_seq_id": 500, "name": "nll",
            "inputs": [{"name": "logprobs", "rank": 1}],
            "graph": {"format": 1, "nodes": [
                {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
                _node("s", "sum", LP, op="call_method"),
                {"op": "output", "name": "output", "target": "output",
                 "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}], "kwargs": {}}]},
            "type": "create_custom_loss"}
    body.update(over)
    return body


@pytest.mark.parametrize("over, status, match", [
    ({"custom_loss_seq_id": -1}, 400, "custom_loss_seq_id"),
    ({"custom_loss_seq_id": "x"}, 400, "custom_loss_seq_id"),
    ({"graph": None}, 400, "graph"),
    ({"inputs": [{"name": "logprobs", "rank": 0}]}, 400, "logprobs"),
    ({"inputs": [{"name": "logprobs", "rank": 1}, {"name": "Weights!", "rank": 1}]}, 400, "inputs\\[1\\]"),
    ({"inputs": [{"name": "weights", "rank": 1}]}, 400, "inputs\\[0\\] must be logprobs"),
    ({"name": ""}, 400, "name"),
    ({"session_id": "no-such-session"}, 404, "session 'no-such-session' not found"),
])
def test_bad_create_custom_loss_bodies_get_a_4xx_naming_the_field(server, sc, over, status, match):
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/create_custom_loss", json=_body(sc.holder.get_session_id(), **over))
    assert r.status_code == status, r.text
    assert re.search(match, r.text), r.text


def test_another_keys_session_is_not_found(restricted_server, service_client):
    from tests.e2e.conftest import KEY_A, KEY_B

    a = service_client(restricted_server, api_key=KEY_A)
    with raw_client(restricted_server.base_url, api_key=KEY_B) as http:
        r = http.post("/api/v1/create_custom_loss", json=_body(a.holder.get_session_id()))
    assert r.status_code == 404, r.text


def test_a_retried_upload_gets_the_same_loss_and_a_reused_number_conflicts(server, sc):
    sid = sc.holder.get_session_id()
    with raw_client(server.base_url) as http:
        ids = []
        for _ in range(2):
            r = http.post("/api/v1/create_custom_loss", json=_body(sid, custom_loss_seq_id=600))
            assert r.status_code == 200, r.text
            ids.append(http.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}).json())
        assert ids[0] == ids[1] == {"loss_id": f"{sid}:loss:600", "type": "create_custom_loss"}
        r = http.post("/api/v1/create_custom_loss", json=_body(sid, custom_loss_seq_id=600, name="other"))
        assert r.status_code == 409 and "custom_loss_seq_id 600" in r.text, r.text


def test_losses_outlive_a_restart_and_are_capped_per_session(make_server, base_model):
    srv = make_server(extra_args=["--custom-loss-max-per-session", "2"])
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-e2e-local")
    try:
        fn, ranks = LOSSES["weighted_nll"]
        handle = sc.create_custom_loss(fn, ranks).result(timeout=RESULT_TIMEOUT_S)
        data = make_data("weighted_nll", seed=3)
        before = lora_client(sc, base_model, rank=4, seed=8).forward_backward_custom(data, handle).result(
            timeout=RESULT_TIMEOUT_S)
        srv.restart()
        # the run was in memory and is lost; a new run of the same session uses the stored loss
        after = lora_client(sc, base_model, rank=4, seed=8).forward_backward_custom(data, handle).result(
            timeout=RESULT_TIMEOUT_S)
        assert after.metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
        fn2, ranks2 = LOSSES["ppo_clipped"]
        sc.create_custom_loss(fn2, ranks2).result(timeout=RESULT_TIMEOUT_S)
        fn3, ranks3 = LOSSES["dpo_style"]
        with pytest.raises(tinker.BadRequestError, match="--custom-loss-max-per-session"):
            sc.create_custom_loss(fn3, ranks3).result(timeout=RESULT_TIMEOUT_S)
    finally:
        sc.close("success")


def test_the_server_can_keep_custom_losses_on_the_client(make_server, base_model):
    srv = make_server(extra_args=["--custom-loss-client-side"])
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-e2e-local")
    try:
        fn, ranks = LOSSES["weighted_nll"]
        handle = sc.create_custom_loss(fn, ranks).result(timeout=RESULT_TIMEOUT_S)
        assert handle.loss_id is None
        out = lora_client(sc, base_model, rank=4, seed=8).forward_backward_custom(
            make_data("weighted_nll", seed=3), handle).result(timeout=RESULT_TIMEOUT_S)
        assert "surrogate_loss:sum" in out.metrics  # the SDK's two-pass client-side path
    finally:
        sc.close("success")
