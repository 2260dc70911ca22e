"""trainer_state.json: the rejected count it records is derived from the tickets, and
the staleness gate (its one live owner) restores from it exactly."""

import json

import pytest

from areal_ray.data.staleness import StalenessGate
from areal_ray.train.checkpoint import STATE_FILE, read_trainer_state, trainer_state


def test_the_derived_count_is_the_gates_count_at_a_step_boundary():
    # B = 2; tickets 0..4 delivered, the dynamic filter drops ticket 2: two steps train
    # tickets {0, 1} and {3, 4}, and the trainer's cursor stops at 5
    gate = StalenessGate(eta=4, batch_groups=2)
    for _ in range(5):
        gate.try_acquire()
        gate.finish()
    gate.reject(1)
    gate.set_version(2)
    state = trainer_state(version=2, next_ticket=5, batch_groups=2, consumed=[10, 11, 12, 13, 14])
    assert state["rejected"] == gate.state.rejected == 1

    resumed = StalenessGate(eta=4, batch_groups=2)
    resumed.restore(state["version"], state["next_ticket"], state["rejected"])
    assert resumed.capacity() == gate.capacity()  # the bound goes on where it was
    with pytest.raises(ValueError, match="inconsistent resume state"):  # another batch size
        StalenessGate(eta=4, batch_groups=3).restore(
            state["version"], state["next_ticket"], state["rejected"])


def test_a_cursor_behind_the_trained_groups_is_refused():
    with pytest.raises(ValueError, match="below the 3 x 4 groups"):
        trainer_state(version=3, next_ticket=11, batch_groups=4, consumed=[])


def test_an_earlier_checkpoints_state_file_reads_the_same(tmp_path):
    # as the trainer wrote it when it counted rejections itself
    old = {"version": 4, "next_ticket": 10, "rejected": 2, "consumed": list(range(10))}
    (tmp_path / STATE_FILE).write_text(json.dumps(old))
    assert read_trainer_state(tmp_path) == {**old, "records": []} \
        == trainer_state(4, 10, 2, list(range(10)))
