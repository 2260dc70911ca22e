"""StepAssembler over a real Ray Data iterator: exact tickets per step, in order."""

import pytest
import ray

from areal_ray.train.feeder import ShardFeeder, StepAssembler
from areal_ray.types import Group


def rows(tickets):
    return [Group(t, f"u{t}", "p", "1", "math", 0).to_row() for t in tickets]


def test_steps_are_assembled_by_ticket_whatever_the_arrival_order(ray_cluster):
    it = ray.data.from_items(rows([3, 0, 5, 1, 2, 4]), override_num_blocks=6).iterator()
    asm = StepAssembler(ShardFeeder(it), batch_groups=2, distributed=False)
    got = [[g.ticket for g in asm.next_step(s)[0]] for s in range(3)]
    assert got == [[0, 1], [2, 3], [4, 5]]


def test_an_incomplete_step_is_an_error_not_a_hang(ray_cluster):
    it = ray.data.from_items(rows([0, 2]), override_num_blocks=2).iterator()
    asm = StepAssembler(ShardFeeder(it), batch_groups=2, distributed=False)
    with pytest.raises(RuntimeError, match="incomplete"):
        asm.next_step(0)


def test_a_duplicated_ticket_is_an_error(ray_cluster):
    it = ray.data.from_items(rows([0, 0, 1]), override_num_blocks=3).iterator()
    asm = StepAssembler(ShardFeeder(it), batch_groups=2, distributed=False)
    with pytest.raises(RuntimeError, match="twice"):
        asm.next_step(0)
