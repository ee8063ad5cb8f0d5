"""Ranks placed by Ray (``--ray-address``) on a local Ray cluster: rank 0 in this process, rank 1
a Ray actor, gloo between them. The group gives one process's results; an actor that Ray reports
dead fails the next call naming the rank, and under a server turns /healthz 503 and fails
requests instead of hanging them; a hung actor fails the call at the collective timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.parallel.scenario import assert_group_matches, group_reference, make_data
from tinsmith.errors import InvalidInputError
from tinsmith.parallel.group import ParallelError
from tinsmith.types import ForwardBackwardInput
from tinsmith.worker.runtime import TrainRequest

TIMEOUT_S = 10.0
REPO = Path(__file__).resolve().parents[2]


def test_without_ray_the_option_says_what_to_install(monkeypatch):
    import sys

    from tinsmith.parallel.ray_group import connect_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(InvalidInputError, match=r"--ray-address needs Ray.*tinsmith\[ray\]"):
        connect_ray("auto")


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:1", "--ray-address 127.0.0.1:1: nothing answers there"),
    ("ray://head:10001", "--ray-address must be auto or HOST:PORT"),
])
def test_an_address_that_cannot_be_a_ray_head_is_refused_at_once(address, message):
    from tinsmith.parallel.ray_group import _check_answers  # what connect_ray asks before Ray would retry for minutes

    with pytest.raises(InvalidInputError, match=message):
        _check_answers(address)


def test_rank_0_runs_on_the_gpu_ray_reserved_for_it_as_this_process_counts_them(monkeypatch):
    from tinsmith.parallel.ray_group import _local_cuda_index

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _local_cuda_index(2) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert _local_cuda_index(5) == 1 and _local_cuda_index("3") == 0
    with pytest.raises(InvalidInputError, match="Ray reserved GPU 4 .* CUDA_VISIBLE_DEVICES=3, 5"):
        _local_cuda_index(4)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for this module (its workers import this tree's tinsmith and tests)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tinsmith[ray]')")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # address="local": a cluster of its own, even where `ray start` runs one on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


def _assert_released(ray, limit_s: float = 10.0) -> None:
    """Every CPU of the cluster is free again: the placement group was removed (Ray does it
    in the background)."""
    end = time.monotonic() + limit_s
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < end:
        time.sleep(0.05)
    assert ray.available_resources().get("CPU") == 2.0


def _wait_unhealthy(group, limit_s: float = 10.0) -> None:
    """Ray reports a killed actor within moments, not at once."""
    end = time.monotonic() + limit_s
    while group.healthy and time.monotonic() < end:
        time.sleep(0.05)
    assert not group.healthy


@pytest.mark.slow
def test_ray_group_matches_one_process_and_reports_a_killed_actor(ray_cluster, qwen3_dir):
    from tinsmith.parallel.ray_group import RayTPGroup
    from tinsmith.parallel.worker import rank_worker_factory

    ref = group_reference(str(qwen3_dir))
    make_target = rank_worker_factory(str(qwen3_dir), runtime_kwargs={"logit_chunk_bytes": 4 * ref.vocab * 5})
    group = RayTPGroup(2, "auto", make_target, timeout_s=TIMEOUT_S)
    try:
        assert_group_matches(group, ref)
        ray_cluster.kill(group.actors[0])
        _wait_unhealthy(group)
        t0 = time.monotonic()
        with pytest.raises(ParallelError, match="rank 1 of 2 .*Ray actor .* died"):
            group.call("train", "forward_backward",
                       [TrainRequest(0, ForwardBackwardInput(make_data(1, [5], ref.vocab), "cross_entropy"))])
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(ParallelError, match="group is down"):
            group.call("train", "unit", 0)
    finally:
        group.close()
    _assert_released(ray_cluster)


@pytest.mark.slow
def test_a_hung_ray_actor_fails_the_call_within_the_timeout(ray_cluster):
    from tests.parallel.scenario import StallingRank
    from tinsmith.parallel.ray_group import RayTPGroup

    group = RayTPGroup(2, "auto", StallingRank, timeout_s=2.0)
    try:
        assert group.call("stall", 1, 0.0) == 0
        t0 = time.monotonic()
        with pytest.raises(ParallelError, match="outcome exchange after stall failed on rank 0 of 2"):
            group.call("stall", 1, 6.0)
        assert time.monotonic() - t0 < 2.0 + 4.0  # slack for a loaded machine
        assert not group.healthy and "did not join within 2 s" in group.failure
        with pytest.raises(ParallelError, match="group is down"):
            group.call("stall", 1, 0.0)
    finally:
        group.close(wait_s=1.0)
    _assert_released(ray_cluster)


@pytest.mark.slow
def test_a_cluster_too_small_is_refused_naming_the_option(ray_cluster, qwen3_dir):
    from tinsmith.parallel.ray_group import RayTPGroup
    from tinsmith.parallel.worker import rank_worker_factory

    with pytest.raises(InvalidInputError, match="--ray-address: the Ray cluster cannot place 3 ranks"):
        RayTPGroup(3, "auto", rank_worker_factory(str(qwen3_dir)), timeout_s=2.0)
    _assert_released(ray_cluster)


@pytest.mark.slow
@pytest.mark.parametrize("layout, label", [("tensor_parallel_size", "tensor-parallel"),
                                           ("data_parallel_size", "data-parallel")])
def test_a_server_whose_ray_actor_is_killed_fails_requests_and_healthz(ray_cluster, qwen3_dir, tmp_path, layout,
                                                                       label):
    """Shards (--tensor-parallel-size) or replicas (--data-parallel-size) placed by Ray alike."""
    from fastapi.testclient import TestClient

    from tests.server.test_tensor_parallel_fault import DATUM, KEY
    from tinsmith.api.app import create_app
    from tinsmith.server.config import ServerConfig
    from tinsmith.server.state import ServerState

    state = ServerState.build(ServerConfig(base_model=[str(qwen3_dir)], data_dir=str(tmp_path), warm_up=False,
                                           device="cpu", ray_address="auto", **{layout: 2}))
    with TestClient(create_app(state)) as client:
        def answer(path: str, body: dict) -> dict:
            rid = client.post(f"/api/v1/{path}", json=body, headers=KEY).json()["request_id"]
            r = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=KEY)
            assert r.status_code == 200, r.text
            return r.json()

        session = client.post("/api/v1/create_session", json={"tags": []}, headers=KEY).json()["session_id"]
        model = answer("create_model", {"session_id": session, "model_seq_id": 1, "lora_config": {"rank": 4},
                                         "base_model": state.config.base_model[0]})["model_id"]
        fb = {"model_id": model, "seq_id": 1, "forward_backward_input": {"data": [DATUM], "loss_fn": "cross_entropy"}}
        assert "loss_fn_outputs" in answer("forward_backward", fb)
        assert client.get("/api/v1/healthz").status_code == 200

        group = state.worker.tp_group
        ray_cluster.kill(group.actors[0])
        _wait_unhealthy(group)
        health = client.get("/api/v1/healthz")
        assert health.status_code == 503 and f"{label} rank 1 of 2" in health.json()["reason"]
        failed = answer("forward_backward", {**fb, "seq_id": 2})
        assert "rank 1 of 2" in failed["error"] and "died" in failed["error"], failed
        assert failed["category"] == "server"
        later = answer("optim_step", {"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}})
        assert "device failed" in later["error"], later
    _assert_released(ray_cluster)
