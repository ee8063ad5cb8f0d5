"""Which per-key limits a server enforces: all of them with a keys file, none of the per-key
caps in single-user mode (one tenant has no other tenant to protect), the storage quota in both."""

from __future__ import annotations

import pytest

from tinsmith.errors import TooManyRequestsError
from tinsmith.server.config import ServerConfig
from tinsmith.server.state import ServerState


def _built(tmp_path, keys: list[str] | None) -> ServerState:
    keys_file = None
    if keys is not None:
        keys_file = tmp_path / "keys.txt"
        keys_file.write_text("\n".join(keys) + "\n")
    cfg = ServerConfig(base_model=["unused"], data_dir=str(tmp_path), api_keys_file=keys_file and str(keys_file),
                       checkpoint_quota_bytes=1000)
    return ServerState.build(cfg)


def test_single_user_mode_has_no_per_key_caps_but_keeps_the_quota(tmp_path):
    state = _built(tmp_path, None)
    try:
        o = state.worker.options
        assert (o.max_runs_per_key, o.max_sampler_snapshots_per_key) == (None, None)
        assert o.max_sampler_snapshots == ServerConfig().max_sampler_snapshots  # the server-wide cap stays
        assert state.limits.max_requests_in_flight is None
        assert not state.request_rates.enabled  # nor a request rate
        state.limits.admit("local", 10**6)  # never a 429, however much is in flight
        assert state.limits.checkpoint_quota_bytes == 1000
    finally:
        state.store.close()


def test_a_keys_file_turns_the_per_key_caps_on(tmp_path):
    state = _built(tmp_path, ["tml-one", "tml-two"])
    cfg = ServerConfig()
    try:
        o = state.worker.options
        assert (o.max_runs_per_key, o.max_sampler_snapshots_per_key) == (cfg.max_runs_per_key,
                                                                         cfg.max_sampler_snapshots_per_key)
        cap = cfg.max_requests_in_flight_per_key
        state.limits.admit("key-x", cap - 1)
        with pytest.raises(TooManyRequestsError) as exc:
            state.limits.admit("key-x", cap)
        assert exc.value.status == 429 and exc.value.retry_after_s > 0
        assert (state.request_rates.per_second, state.request_rates.burst) == (cfg.max_requests_per_second_per_key,
                                                                               cfg.request_burst_per_key)
        assert state.request_rates.enabled
        assert state.limits.checkpoint_quota_bytes == 1000
    finally:
        state.store.close()


@pytest.mark.parametrize("option", ["max_runs_per_key", "max_requests_in_flight_per_key",
                                    "max_sampler_snapshots", "max_sampler_snapshots_per_key"])
def test_a_cap_below_one_is_refused_at_start(option):
    with pytest.raises(ValueError, match=f"--{option.replace('_', '-')} must be at least 1"):
        ServerConfig(**{option: 0}).validate()
