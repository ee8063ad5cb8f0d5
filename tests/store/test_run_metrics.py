"""Run metric history: written with the request's result, bounded per run, read for the dashboard."""

from __future__ import annotations

import math

from tinsmith.store import MetricPoint, Store, model_id_for


def _request(store: Store, model_id: str, seq: int, owner: str = "alice") -> str:
    rec, _ = store.create_request(owner=owner, kind="forward_backward", payload=b"{}", payload_type="json",
                                  model_id=model_id, seq_id=seq)
    return rec.request_id


def test_a_point_is_recorded_with_the_result_once(store: Store) -> None:
    m = model_id_for("s1", 0)
    rid = _request(store, m, 1)
    point = MetricPoint(m, "alice", 0, "forward_backward", {"loss:sum": 2.5, "odd": math.nan})
    assert store.complete_request(rid, b"{}", "application/json", metric_point=point)
    # A second outcome of the same request (a replay) is refused, and adds no point.
    assert not store.complete_request(rid, b"{}", "application/json", metric_point=point)
    [got] = store.list_run_metrics(m)
    assert (got.model_id, got.owner, got.step, got.kind) == (m, "alice", 0, "forward_backward")
    assert got.metrics == {"loss:sum": 2.5, "odd": None}  # non-finite values stored as null (valid JSON)
    assert store.get_request(rid).status == "completed"
    # Results without metrics record nothing.
    assert store.complete_request(_request(store, m, 2), b"{}", "application/json")
    assert len(store.list_run_metrics(m)) == 1


def test_optimizer_steps_count_optim_step_points_per_run(store: Store) -> None:
    a, b = model_id_for("s1", 0), model_id_for("s1", 1)
    for seq, (model, step, kind) in enumerate([(a, 0, "forward_backward"), (a, 0, "optim_step"),
                                                (a, 1, "forward_backward"), (a, 1, "optim_step"),
                                                (b, 0, "forward_backward")]):
        store.complete_request(_request(store, model, seq), b"{}", "application/json",
                               metric_point=MetricPoint(model, "alice", step, kind, {"x": 1.0}))
    assert store.optimizer_steps([a, b, "other"]) == {a: 2}
    assert store.optimizer_steps([]) == {}


def test_thinning_keeps_recent_points_whole_and_the_history_bounded(store: Store) -> None:
    a, b = model_id_for("s1", 0), model_id_for("s2", 0)
    for step in range(30):
        store.complete_request(_request(store, a, step), b"{}", "application/json",
                               metric_point=MetricPoint(a, "alice", step, "optim_step", {"loss": float(step)}))
    for step in range(5):
        store.complete_request(_request(store, b, step), b"{}", "application/json",
                               metric_point=MetricPoint(b, "bob", step, "optim_step", {"loss": float(step)}))
    assert store.thin_run_metrics(20) == 10  # a's older 20 points lose every other one; b is under the cap
    steps = [p.step for p in store.list_run_metrics(a)]
    assert steps[-10:] == list(range(20, 30))  # the newest half untouched
    assert steps[:10] == list(range(0, 20, 2))  # the older part thinned evenly, the first point kept
    assert len(store.list_run_metrics(b)) == 5
    assert store.thin_run_metrics(20) == 0  # now within the cap


def test_recent_models_of_one_owner_or_all(store: Store) -> None:
    for i, owner in enumerate(["alice", "bob", "alice"]):
        store.create_model(model_id_for("s", i), owner=owner, base_model="m", session_id="s", model_seq_id=i)
    store.touch_model(model_id_for("s", 0))
    assert [m.model_id for m in store.list_recent_models("alice")] == [model_id_for("s", 0), model_id_for("s", 2)]
    assert len(store.list_recent_models(None)) == 3
    assert len(store.list_recent_models(None, limit=2)) == 2
