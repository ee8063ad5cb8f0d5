"""Bad RL and checkpoint input through the SDK: the call fails with a message naming the problem,
never with an internal error, and the run stays usable."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from tests.e2e.helpers import RESULT_TIMEOUT_S, assert_no_internal_errors, detail, lora_client, raw_client
from tests.rl.helpers import PROMPT

pytestmark = pytest.mark.e2e

@pytest.fixture(autouse=True)
def _no_internal_errors(server):
    before = len(server.log_text())
    yield
    assert_no_internal_errors(server.log_text()[before:])


@pytest.fixture
def tc(sc, base_model):
    return lora_client(sc, base_model, rank=4, seed=2)


def _rl_datum(**drop_or_add) -> types.Datum:
    full = PROMPT + [101, 202]
    n = len(full) - 1
    inputs = {"target_tokens": full[1:], "logprobs": [-1.0] * n, "advantages": [0.5] * n}
    for k, v in drop_or_add.items():
        if v is None:
            inputs.pop(k)
        else:
            inputs[k] = v
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def _fails(fut) -> str:
    with pytest.raises(tinker.TinkerError) as exc:
        fut.result(timeout=RESULT_TIMEOUT_S)
    err = exc.value
    if isinstance(err, tinker.RequestFailedError):
        assert err.category == "user", err
    elif isinstance(err, tinker.APIStatusError):
        assert 400 <= err.status_code < 500, err
    else:
        raise AssertionError(f"unexpected {type(err).__name__}: {err}")
    return str(err)


def test_unknown_loss_name(tc):
    msg = _fails(tc.forward_backward([_rl_datum()], "reinforce_plus_plus"))
    assert "reinforce_plus_plus" in msg and "importance_sampling" in msg


@pytest.mark.parametrize("loss_fn,missing", [
    ("importance_sampling", "advantages"),
    ("importance_sampling", "logprobs"),
    ("ppo", "advantages"),
    ("gspo", "sequence_ratio_mask"),
])
def test_missing_loss_input_is_named(tc, loss_fn, missing):
    datum = _rl_datum(**{missing: None}) if missing != "sequence_ratio_mask" else _rl_datum()
    msg = _fails(tc.forward_backward([datum], loss_fn))
    assert missing in msg and loss_fn in msg


def test_bad_loss_config_and_shapes(tc):
    msg = _fails(tc.forward_backward([_rl_datum()], "ppo", {"clip_epsilon": 0.2}))
    assert "clip_epsilon" in msg and "clip_low_threshold" in msg
    msg = _fails(tc.forward_backward([_rl_datum(advantages=[1.0, 2.0])], "importance_sampling"))
    assert "advantages" in msg
    # stable_reinforce with neither client logprobs nor a server record of the sampling
    msg = _fails(tc.forward_backward([_rl_datum(logprobs=None)], "stable_reinforce"))
    assert "logprobs" in msg
    # the run is still usable, and nothing was applied by the failed calls
    ok = tc.forward_backward([_rl_datum()], "importance_sampling").result(timeout=RESULT_TIMEOUT_S)
    assert "loss:sum" in ok.metrics


def test_bad_checkpoint_names_and_ttls(tc, server):
    msg = _fails(tc.save_state("a/b"))
    assert "a/b" in msg
    msg = _fails(tc.save_state("short-ttl", ttl_seconds=10))
    assert "ttl_seconds" in msg
    with raw_client(server.base_url) as http:
        r = http.post("/api/v1/save_weights_external", json={"model_id": str(tc.model_id), "path": "..",
                                                              "seq_id": 10_000})
        assert r.status_code == 400 and "'..'" in detail(r)
    assert tc.save_state("fine", ttl_seconds=3600).result(timeout=RESULT_TIMEOUT_S).path.endswith("/weights/fine")


def test_sampler_weights_ttl_is_range_checked(tc):
    msg = _fails(tc.save_weights_for_sampler("short-ttl-s", ttl_seconds=10))
    assert "ttl_seconds" in msg
