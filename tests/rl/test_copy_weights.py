"""RestClient.copy_weights: a copy in a new, untrainable run that outlives its source."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e


def test_copy_weights_survives_deleting_the_source(server, base_model, sc):
    tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("to-copy").result().path
    expected = np.asarray(tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    rc = tinker.RestClient(base_url=server.base_url, api_key="tml-e2e-local")  # the key of ``sc``
    copy = rc.copy_weights(state, "team-b").result()
    assert copy.startswith("tinker://copy-") and copy.endswith("/weights/to-copy")
    run = rc.get_training_run_by_tinker_path(copy).result()
    assert run.user_metadata["copied_from"] == state and run.base_model == tc.get_info().model_data.model_name
    rc.delete_checkpoint_from_tinker_path(state).result()
    restored = sc.create_training_client_from_state(copy).result()
    got = np.asarray(restored.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
