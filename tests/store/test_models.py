from __future__ import annotations

import pytest

from tinsmith.store import Store, model_id_for

LORA = {
    "rank": 8,
    "seed": 3,
    "alpha": 32.0,
    "train_attn": True,
    "train_mlp": True,
    "train_unembed": False,
}


def _create(store: Store, session_id: str, seq: int, owner: str = "alice", **kw):
    return store.create_model(
        model_id_for(session_id, seq),
        owner=owner,
        base_model=kw.pop("base_model", "Qwen/Qwen3-0.6B"),
        session_id=session_id,
        model_seq_id=seq,
        **kw,
    )


def test_create_model_and_defaults(store: Store) -> None:
    model, created = _create(
        store, "s1", 0, lora_rank=8, lora_config=LORA, user_metadata={"exp": "x"}
    )
    assert created
    assert model.model_id == "s1:train:0"
    assert model == store.get_model("s1:train:0")
    assert model.is_lora and model.lora_rank == 8 and model.lora_config == LORA
    assert model.optimizer_config == {"type": "adamw"}
    assert model.status == "active" and not model.corrupted and model.last_seq_id == 0
    assert model.created_at == model.last_request_at
    assert store.get_model("s1:train:1") is None


def test_create_model_is_idempotent(store: Store) -> None:
    first, created = _create(store, "s1", 0, lora_rank=8)
    again, created_again = _create(store, "s1", 0, lora_rank=64, base_model="other")
    assert created and not created_again
    assert again == first  # the replay changes nothing
    assert store.list_models("alice").total == 1


def test_list_models_pagination_and_project(store: Store) -> None:
    s1 = store.create_session("alice", project_id="p1")
    s2 = store.create_session("alice")
    ids = [_create(store, s1.session_id, i)[0].model_id for i in range(3)]
    ids.append(_create(store, s2.session_id, 0)[0].model_id)
    _create(store, "other-session", 0, owner="bob")

    page = store.list_models("alice", limit=3, offset=0)
    assert page.total == 4 and (page.limit, page.offset) == (3, 0)
    assert [m.model_id for m in page.items] == ids[::-1][:3]
    assert [m.model_id for m in store.list_models("alice", 3, 3).items] == ids[:1]
    in_p1 = store.list_models("alice", project_id="p1")
    assert in_p1.total == 3 and {m.model_id for m in in_p1.items} == set(ids[:3])
    assert store.list_models("bob").total == 1
    assert [m.model_id for m in store.list_session_models(s1.session_id)] == ids[:3]


def test_status_touch_and_seq(store: Store, clock) -> None:
    model, _ = _create(store, "s", 0)
    assert store.update_model_status(model.model_id, "lost", corrupted=True)
    got = store.get_model(model.model_id)
    assert got.status == "lost" and got.corrupted
    assert [m.model_id for m in store.list_models_by_status("lost")] == [model.model_id]
    assert store.list_models_by_status("active") == []
    assert store.update_model_status(model.model_id, "active")
    assert store.get_model(model.model_id).corrupted  # untouched when not given
    with pytest.raises(ValueError):
        store.update_model_status(model.model_id, "bogus")
    assert not store.update_model_status("missing", "active")

    clock.advance(5)
    assert store.touch_model(model.model_id)
    assert store.get_model(model.model_id).last_request_at > model.last_request_at

    assert store.set_last_seq_id(model.model_id, 3)
    assert not store.set_last_seq_id(model.model_id, 2)  # never goes back
    assert not store.set_last_seq_id(model.model_id, 3)
    assert store.get_model(model.model_id).last_seq_id == 3
    assert not store.set_last_seq_id("missing", 1)
