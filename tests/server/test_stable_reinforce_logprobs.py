"""stable_reinforce reads the logprobs the server recorded at sampling time through provenance spans."""

from __future__ import annotations

import numpy as np
import pytest

from tinsmith.errors import InvalidInputError
from tinsmith.server.operations import WorkerOperations
from tinsmith.types import Datum, ForwardBackwardInput, ProvenanceSpan


def _datum(targets, client_lp=None):
    inputs = {"target_tokens": np.array(targets), "advantages": np.ones(len(targets), np.float32)}
    if client_lp is not None:
        inputs["logprobs"] = np.array(client_lp, np.float32)
    # Prompt of 3 tokens (targets at positions 0..1 are prompt tokens), then 3 sampled tokens.
    spans = [ProvenanceSpan("prompt", "s1", 1, 2), ProvenanceSpan("sampled", "s1", 0, 3)]
    return Datum(np.arange(len(targets)), inputs, loss_input_spans=spans)


def test_recorded_logprobs_replace_client_values_on_sampled_positions():
    ops = WorkerOperations(worker=None)
    ops.stability.put("s1", np.array([7, 8, 9], np.int32), np.array([-0.1, -0.2, -0.3], np.float32))
    d = _datum([5, 6, 7, 8, 9], client_lp=[0.0, 0.0, -9.0, -9.0, -9.0])
    ops.fill_recorded_logprobs(ForwardBackwardInput([d], "stable_reinforce"))
    np.testing.assert_allclose(d.loss_inputs["logprobs"], [0.0, 0.0, -0.1, -0.2, -0.3])


def test_mismatched_tokens_keep_client_values_and_missing_everything_is_an_error():
    ops = WorkerOperations(worker=None)
    ops.stability.put("s1", np.array([1, 2, 3], np.int32), np.array([-0.1, -0.2, -0.3], np.float32))
    d = _datum([5, 6, 7, 8, 9], client_lp=[0.0, 0.0, -9.0, -9.0, -9.0])
    ops.fill_recorded_logprobs(ForwardBackwardInput([d], "stable_reinforce"))
    np.testing.assert_allclose(d.loss_inputs["logprobs"], [0.0, 0.0, -9.0, -9.0, -9.0])
    with pytest.raises(InvalidInputError, match="record_stability_info"):
        ops.fill_recorded_logprobs(ForwardBackwardInput([_datum([5, 6, 7, 8, 9])], "stable_reinforce"))
