"""StepAssembler over a real Ray Data iterator: exact tickets per step, in order."""

import pytest
import ray

from areal_ray.train.feeder import ShardFeeder, StepAssembler
from areal_ray.types import Group, Sample


def rows(tickets, informative=()):
    """Groups of two samples; rewards differ only for tickets in `informative`."""
    out = []
    for t in tickets:
        samples = [Sample([1], [2], [0.0], [0], "stop", reward=r)
                   for r in ((0.0, 1.0) if t in informative else (1.0, 1.0))]
        out.append(Group(t, f"u{t}", "p", "1", "math", 0, samples, pos=100 + t).to_row())
    return out


def test_steps_are_assembled_by_ticket_whatever_the_arrival_order(ray_cluster):
    it = ray.data.from_items(rows([3, 0, 5, 1, 2, 4]), override_num_blocks=6).iterator()
    asm = StepAssembler(ShardFeeder(it), batch_groups=2, distributed=False)
    got = [[g.ticket for g in asm.next_step(s).groups] for s in range(3)]
    assert got == [[0, 1], [2, 3], [4, 5]]


def test_dynamic_filter_skips_all_equal_groups_in_ticket_order(ray_cluster):
    """Tickets 1, 2 and 5 carry no signal: steps are the next B informative tickets, the
    dropped positions are returned with the step that walked past them, and every
    rejection is reported as soon as it arrives (before the walk reaches it)."""
    it = ray.data.from_items(rows([5, 0, 3, 1, 2, 4, 6], informative={0, 3, 4, 6}),
                             override_num_blocks=7).iterator()
    reported = []
    asm = StepAssembler(ShardFeeder(it), batch_groups=2, distributed=False,
                        accept=lambda g: len({s.reward for s in g.samples}) > 1,
                        on_reject=reported.append)
    first = asm.next_step(0)
    assert [g.ticket for g in first.groups] == [0, 3] and first.rejected == [101, 102]
    second = asm.next_step(1)
    assert [g.ticket for g in second.groups] == [4, 6] and second.rejected == [105]
    assert sum(reported) == 3 and asm.cursor == 7


def test_resume_starts_at_the_checkpoint_cursor(ray_cluster):
    it = ray.data.from_items(rows([9, 8]), override_num_blocks=2).iterator()
    asm = StepAssembler(ShardFeeder(it), batch_groups=2, distributed=False, next_ticket=8)
    assert [g.ticket for g in asm.next_step(4).groups] == [8, 9]


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


def test_abandoned_episodes_are_counted_among_the_rejected(ray_cluster):
    """A row whose episode passed rollout.episode_timeout_s arrives as an empty group
    marked abandoned: rejected like any other, and counted apart in the step."""
    from areal_ray.rollout.workflows.base import ABANDONED
    from areal_ray.train.loop import has_samples
    items = rows([0, 2, 3])
    late = Group(1, "u1", "p", "1", "math", 0, [], pos=101)
    late.meta[ABANDONED] = 1800.0
    it = ray.data.from_items(items + [late.to_row()], override_num_blocks=4).iterator()
    asm = StepAssembler(ShardFeeder(it), batch_groups=3, distributed=False, accept=has_samples)
    step = asm.next_step(0)
    assert [g.ticket for g in step.groups] == [0, 2, 3]
    assert step.rejected == [101] and step.abandoned == 1


def test_groups_the_teacher_dropped_are_counted_among_the_rejected(ray_cluster):
    """algo.distill.late=drop: a group the teacher did not score in time arrives emptied
    and marked (distill/advantage.py); rejected, and counted apart from abandoned ones."""
    from areal_ray.distill.advantage import LATE, mark
    from areal_ray.train.loop import has_samples
    items = rows([0, 2])
    dropped = mark(Group(1, "u1", "p", "1", "math", 0, [Sample([1], [2], [0.0], [0], "stop")],
                         pos=101), LATE, 30.0, "slow", drop=True)
    it = ray.data.from_items(items + [dropped.to_row()], override_num_blocks=3).iterator()
    step = StepAssembler(ShardFeeder(it), batch_groups=2, distributed=False,
                         accept=has_samples).next_step(0)
    assert [g.ticket for g in step.groups] == [0, 2]
    assert step.rejected == [101] and (step.teacher_dropped, step.abandoned) == (1, 0)
