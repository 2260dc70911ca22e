"""Fleet and EventLog without Ray."""

import asyncio

from areal_ray.driver.events import EventLog
from areal_ray.driver.fleet import Fleet


def test_sweep_forgets_dead_replicas_and_reward_actors():
    f = Fleet()
    f.watch_replica("r1", "alive"), f.watch_replica("r2", "dead")
    f.watch_reward_actor("w1", "dead"), f.watch_reward_actor("w2", "alive")

    async def alive(handle):
        return handle == "alive"

    assert asyncio.run(f.sweep(alive)) == ["r2"]
    assert list(f.replicas) == ["r1"] and list(f.reward_actors) == ["w2"]


def test_load_reports_are_thinned_past_the_cap_keeping_first_and_last():
    f = Fleet(max_reports=10)
    for i in range(11):
        f.report_load("a", {"time": float(i), "busy_s": i / 2, "tokens": i, "running": 1, "queued": 0})
    rows = f.loads["a"]
    assert len(rows) < 11 and rows[0]["time"] == 0.0 and rows[-1]["time"] == 10.0


def test_event_log_lets_read_events_go():
    log = EventLog()
    for i in range(3):
        log.append({"i": i})
    assert [e["i"] for e in log.read(0)] == [0, 1, 2]
    assert [e["i"] for e in log.read(2)] == [2]
    log.append({"i": 3})
    assert [e["i"] for e in log.read(3)] == [3]
    assert [e["i"] for e in log.read(0)] == [3]  # read before: gone
    assert log.read(4) == []


def test_replicas_found_dead_count_as_lost_and_those_that_left_do_not():
    f = Fleet()
    for r, h in (("r1", "alive"), ("r2", "dead"), ("r3", "alive"), ("r4", "alive")):
        f.watch_replica(r, h)

    async def alive(handle):
        return handle == "alive"

    asyncio.run(f.sweep(alive))
    f.forget_replica("r3")  # unregistered itself (Serve scaled it down): not a loss
    f.lose_replica("r4")  # found dead by a release round
    f.lose_replica("r4")  # and again by the monitor: counted once
    f.lose_replica("r9")  # never watched
    assert f.replicas_lost == 2 and list(f.replicas) == ["r1"]
