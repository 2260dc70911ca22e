"""Admission without Ray: the gate's decisions and the restart state machine."""

import pytest

from areal_ray.data.staleness import StalenessGate
from areal_ray.driver.admission import WAIT, Admission, Admitted, Phase


def admission(eta=0, b=2, max_concurrent=None) -> Admission:
    return Admission(StalenessGate(eta, b, max_concurrent))


def test_admits_up_to_the_staleness_bound_then_waits_for_a_served_version():
    a = admission(eta=0, b=2)
    assert a.decide(0, 0) == Admitted(0, 0)
    assert a.decide(1, 0) == Admitted(1, 0)
    assert a.decide(2, 0) is WAIT  # eta 0: the next batch needs version 1
    a.finish(0), a.finish(0)
    a.served(1)
    assert a.decide(2, 0) == Admitted(2, 1)


def test_a_rejected_group_frees_its_slot():
    a = admission(eta=0, b=1)
    assert a.decide(0, 0) == Admitted(0, 0)
    a.finish(0)
    assert a.decide(1, 0) is WAIT
    a.reject(1)
    assert a.decide(1, 0) == Admitted(1, 0)


# (phase reached by these calls, what a prompt of the current generation gets)
LIFECYCLE = [
    ([], Phase.RUNNING, "admitted"),
    (["begin_generation"], Phase.RESTORING, "wait"),
    (["begin_generation", "restore"], Phase.RESTORING, "wait"),
    (["begin_generation", "restore", "resume"], Phase.RUNNING, "admitted"),
    (["restore", "resume"], Phase.RUNNING, "admitted"),
    (["begin_generation", "begin_generation", "restore", "resume"], Phase.RUNNING, "admitted"),
    (["close"], Phase.CLOSED, "skip"),
    (["begin_generation", "close"], Phase.CLOSED, "skip"),
    (["close", "begin_generation"], Phase.CLOSED, "skip"),  # closing is terminal
    (["close", "begin_generation", "restore", "resume"], Phase.CLOSED, "skip"),
    (["resume"], Phase.RUNNING, "admitted"),  # resume without a restore changes nothing
]


@pytest.mark.parametrize("calls,phase,outcome", LIFECYCLE)
def test_lifecycle(calls, phase, outcome):
    a = admission(eta=1, b=2)
    for call in calls:
        if call == "restore":
            a.restore(0, 0, 0, [])
        else:
            getattr(a, call)()
    assert a.phase is phase
    got = a.decide(100, a.generation)
    assert {"admitted": isinstance(got, Admitted), "wait": got is WAIT,
            "skip": got is None}[outcome], got


# (calls on an admission made held, what a prompt of the current generation gets)
HELD = [
    ([], "wait"),
    (["release"], "admitted"),
    (["begin_generation", "restore", "resume"], "wait"),  # the trainer's start does not release
    (["begin_generation", "restore", "resume", "release"], "admitted"),
    (["release", "begin_generation"], "wait"),  # a restart still waits for its restore
    (["close"], "skip"),  # a run closed while held admits nothing, released or not
    (["close", "release"], "skip"),
]


@pytest.mark.parametrize("calls,outcome", HELD)
def test_a_held_admission_waits_for_the_release_whatever_the_trainer_does(calls, outcome):
    a = Admission(StalenessGate(1, 2), held=True)
    for call in calls:
        if call == "restore":
            a.restore(0, 0, 0, [])
        else:
            getattr(a, call)()
    got = a.decide(0, a.generation)
    assert {"admitted": isinstance(got, Admitted), "wait": got is WAIT,
            "skip": got is None}[outcome], got


def test_release_says_whether_it_changed_anything():
    a = Admission(StalenessGate(1, 2), held=True)
    assert a.state()["held"] is True
    assert a.release() is True and a.release() is False
    assert a.state()["held"] is False
    assert Admission(StalenessGate(1, 2)).release() is False


def test_an_old_pipeline_is_cut_off_and_consumed_positions_are_skipped():
    a = admission(eta=0, b=2)
    gen = a.begin_generation()
    assert a.decide(5, gen - 1) is None  # the old pipeline's prompts
    assert a.finish(gen - 1) is False  # and its finishes change nothing
    a.restore(0, 0, 0, consumed=[5])
    a.resume()
    assert a.decide(5, gen) is None  # trained before the checkpoint
    assert a.decide(6, gen) == Admitted(0, 0)


def test_restore_resets_tickets_to_the_checkpoint_and_checks_consistency():
    a = admission(eta=0, b=2)
    a.begin_generation()
    a.restore(version=3, next_ticket=7, rejected=1, consumed=[])
    a.resume()
    assert a.decide(0, a.generation) == Admitted(7, 3)
    with pytest.raises(ValueError, match="inconsistent resume state"):
        a.restore(version=3, next_ticket=7, rejected=0)


def test_consumed_positions_are_told_only_after_the_restore():
    a = admission()
    a.begin_generation()
    assert a.consumed_between(10, 20) is WAIT
    a.restore(0, 0, 0, [3, 12, 15, 25])
    assert a.consumed_between(10, 20) is WAIT  # weights may still be publishing
    a.resume()
    assert a.consumed_between(10, 20) == [12, 15]


def test_closed_runs_tell_consumed_positions_at_once():
    a = admission()
    a.begin_generation()
    a.close()
    assert a.consumed_between(0, 10) == []


@pytest.mark.parametrize("read,taken,limit,waits", [
    (3, 0, 4, False), (6, 0, 4, True), (6, 2, 4, False), (6, 1, 4, True), (0, 0, 0, False)])
def test_the_reader_waits_while_too_far_ahead(read, taken, limit, waits):
    a = admission()
    gen = a.begin_generation()
    assert a.read(gen, read)
    for _ in range(taken):
        a.arrive(gen)
    assert a.reader_waits(gen, limit) is waits


def test_a_take_wakes_a_waiting_reader_and_old_readers_are_ignored():
    a = admission()
    gen = a.begin_generation()
    a.read(gen, 6)
    assert a.reader_waits(gen, 4)
    assert a.arrive(gen) is True  # the waiting reader must be woken
    assert a.arrive(gen) is False  # nobody waits any more
    assert a.read(gen - 1, 100) is False
    assert a.reader_waits(gen - 1, 0) is False
    a.close()
    a.read(gen, 100)
    assert a.reader_waits(gen, 0) is False  # a closed run never holds the reader


def test_state_reports_gate_phase_and_reader():
    a = admission(eta=2, b=3)
    s = a.state()
    assert (s["eta"], s["batch_groups"], s["max_concurrent"], s["phase"]) == (2, 3, 9, "running")
    assert {"started", "running", "rejected", "version", "closed", "read", "taken", "ahead"} <= set(s)


def test_wait_stays_one_object_through_pickling():
    import pickle

    import cloudpickle
    assert pickle.loads(pickle.dumps(WAIT)) is WAIT
    assert cloudpickle.loads(cloudpickle.dumps(WAIT)) is WAIT


def test_ordered_admission_gives_tickets_in_stream_order_whatever_the_arrival():
    a = Admission(StalenessGate(1, 2, None), ordered=True)
    assert a.decide(1, 0) is WAIT  # position 0 has not been admitted yet
    assert a.decide(2, 0) is WAIT
    assert a.decide(0, 0) == Admitted(0, 0)
    assert a.decide(2, 0) is WAIT
    assert a.decide(1, 0) == Admitted(1, 0)
    assert a.decide(2, 0) == Admitted(2, 0)


def test_ordered_admission_after_a_restore_starts_at_the_first_unconsumed_position():
    a = Admission(StalenessGate(0, 2, None), ordered=True)
    gen = a.begin_generation()
    a.restore(1, 2, 0, consumed=[0, 1, 3])
    a.resume()
    assert a.decide(4, gen) is WAIT
    assert a.decide(2, gen) == Admitted(2, 1)
    assert a.decide(4, gen) == Admitted(3, 1)  # 3 was consumed: 4 comes next


def test_unordered_admission_takes_arrival_order():
    a = admission(eta=1, b=2)
    assert a.decide(1, 0) == Admitted(0, 0)
    assert a.decide(0, 0) == Admitted(1, 0)
