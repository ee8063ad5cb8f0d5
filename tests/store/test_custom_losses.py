from __future__ import annotations

import pytest

from tinsmith.errors import ConflictError
from tinsmith.store import Store
from tinsmith.store.ids import custom_loss_id_for

INPUTS = [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}]
GRAPH = {"format": 1, "nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [],
                                 "kwargs": {}}, {"op": "output", "name": "output", "target": "output",
                                                 "args": [{"tuple": [{"ref": "logprobs"}, {"dict": {}}]}],
                                                 "kwargs": {}}]}


def create(store: Store, seq: int, name: str = "nll", session: str = "sess", graph=GRAPH):
    return store.create_custom_loss(custom_loss_id_for(session, seq), session_id=session, custom_loss_seq_id=seq,
                                    owner="alice", name=name, inputs=INPUTS, graph=graph)


def test_create_get_and_replay(store: Store) -> None:
    rec, created = create(store, 0)
    assert created and rec.loss_id == "sess:loss:0"
    assert store.get_custom_loss("sess:loss:0") == rec
    assert rec.graph == GRAPH and rec.inputs == INPUTS  # the JSON comes back as sent
    again, created_again = create(store, 0)  # the SDK's retry of the same upload
    assert not created_again and again == rec
    assert store.get_custom_loss("missing") is None


def test_a_used_sequence_number_with_another_loss_conflicts(store: Store) -> None:
    create(store, 0)
    with pytest.raises(ConflictError, match="custom_loss_seq_id 0"):
        create(store, 0, name="other")


def test_count_per_session(store: Store) -> None:
    for seq in range(3):
        create(store, seq)
    create(store, 0, session="elsewhere")
    assert store.count_session_custom_losses("sess") == 3
    assert store.count_session_custom_losses("elsewhere") == 1
    assert store.count_session_custom_losses("none") == 0


def test_survives_reopening(db_url: str) -> None:
    with Store(db_url) as store:
        store.migrate()
        create(store, 5)
    with Store(db_url) as store:
        assert store.get_custom_loss("sess:loss:5").graph == GRAPH
