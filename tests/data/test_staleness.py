"""The staleness gate: formula, eta = 0 is synchronous, and the bound under any order."""

import random

import pytest

from areal_ray.data.staleness import StalenessGate


def test_capacity_formula():
    g = StalenessGate(eta=1, batch_groups=4, max_concurrent=100)
    tickets = [g.try_acquire() for _ in range(10)]
    assert tickets[:8] == list(range(8)) and tickets[8:] == [None, None]  # (0+1+1)*4 = 8
    g.set_version(1)
    assert g.capacity() == 4
    with pytest.raises(ValueError):
        g.set_version(0)


def test_concurrency_cap_and_finish():
    g = StalenessGate(eta=10, batch_groups=4, max_concurrent=2)
    assert g.try_acquire() == 0 and g.try_acquire() == 1 and g.try_acquire() is None
    g.finish()
    assert g.try_acquire() == 2
    g.finish(), g.finish()
    with pytest.raises(RuntimeError):
        g.finish()


def test_eta_zero_admits_exactly_one_batch_per_version():
    g = StalenessGate(eta=0, batch_groups=3)
    for v in range(4):
        got = [g.try_acquire() for _ in range(5)]
        assert got[:3] == [3 * v, 3 * v + 1, 3 * v + 2] and got[3:] == [None, None]
        for _ in range(3):
            g.finish()
        g.set_version(v + 1)


def test_close_and_state_roundtrip():
    g = StalenessGate(eta=2, batch_groups=2)
    g.try_acquire()
    g2 = StalenessGate(eta=2, batch_groups=2)
    g2.load_state_dict(g.state_dict())
    assert g2.try_acquire() == 1
    g2.close()
    assert g2.try_acquire() is None


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_bound_holds_with_random_completion_order(eta, seed):
    """Simulate rollouts finishing in random order, trained by ticket: staleness <= eta."""
    rng, B, steps = random.Random(seed), 3, 12
    g = StalenessGate(eta=eta, batch_groups=B, max_concurrent=rng.randint(1, 20))
    running, done, admitted = [], {}, {}
    for step in range(steps):
        needed = set(range(step * B, (step + 1) * B))
        while not needed <= done.keys():
            while (t := g.try_acquire()) is not None:
                admitted[t] = g.state.version
                running.append(t)
            assert running, "deadlock: the step's groups can never be admitted"
            t = running.pop(rng.randrange(len(running)))  # a random group completes
            g.finish()
            done[t] = admitted[t]  # its oldest token has the admission version
        for t in needed:
            assert 0 <= step - done.pop(t) <= eta
            if eta == 0:
                assert admitted[t] == step
        g.set_version(step + 1)


@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("seed", range(5))
def test_bound_holds_with_dynamic_filter_rejections(eta, seed):
    """Random completion order and random rejections (reported whenever the trainer sees
    them); steps take B accepted groups in ticket order: staleness stays <= eta and the
    run never deadlocks."""
    rng, B, steps = random.Random(seed), 3, 10
    g = StalenessGate(eta=eta, batch_groups=B, max_concurrent=rng.randint(1, 20))
    running, delivered, admitted, cursor = [], {}, {}, 0
    for step in range(steps):
        taken = []
        while len(taken) < B:
            if cursor in delivered:
                ok = delivered.pop(cursor)
                if ok:
                    taken.append(cursor)
                cursor += 1
                continue
            while (t := g.try_acquire()) is not None:
                admitted[t] = g.state.version
                running.append(t)
            assert running, "deadlock: the step's groups can never be admitted"
            t = running.pop(rng.randrange(len(running)))
            g.finish()
            ok = rng.random() < 0.6
            if not ok:
                g.reject()
            delivered[t] = ok
        for t in taken:
            assert 0 <= step - admitted[t] <= eta
        g.set_version(step + 1)


def test_reject_counts_only_delivered_groups_and_restore_checks_consistency():
    g = StalenessGate(eta=0, batch_groups=2)
    g.try_acquire(), g.try_acquire()
    with pytest.raises(RuntimeError):
        g.reject()  # both still running
    g.finish()
    g.reject()
    assert g.try_acquire() == 2  # the rejected group's slot is free again
    g2 = StalenessGate(eta=0, batch_groups=2)
    g2.restore(version=3, next_ticket=8, rejected=2)
    assert g2.capacity() == 2 and g2.try_acquire() == 8
    with pytest.raises(ValueError, match="inconsistent"):
        g2.restore(version=3, next_ticket=8, rejected=1)
