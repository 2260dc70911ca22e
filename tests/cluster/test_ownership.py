"""Which resources of which jobs a sweep removes (areal_ray/cluster/ownership.py), table by
table, without Ray; `tests/jobs/test_cleanup.py` kills a real job on a `ray start` cluster."""

import pytest

from areal_ray.cluster.ownership import (Actor, Owned, live_tags, new_tag, parse_weight_file,
                                         stale_apps, stale_files, stale_pg_cleaners, tag_of_app,
                                         tag_of_driver)

DEAD, LIVE, ME = "deadbeef", "0123abcd", "feedf00d"


def test_a_tag_names_everything_its_job_owns():
    o = Owned(LIVE)
    assert (o.driver_name, o.app_name) == ("areal-driver-0123abcd", "areal-rollout-0123abcd")
    assert o.weight_file("weights", 42, "0.bin") == "areal-weights-0123abcd-42-0.bin"
    assert tag_of_driver(o.driver_name) == tag_of_app(o.app_name) == LIVE
    assert parse_weight_file(o.weight_file("vllm", 7, "ab12.safetensors")) == (LIVE, 7)
    assert Owned(new_tag()).tag != Owned(new_tag()).tag


@pytest.mark.parametrize("bad, message", [
    ("ABCDEF12", "is not 8 lowercase hex digits"), ("abc", "is not 8 lowercase hex digits"),
    ("0123abcd-x", "is not 8 lowercase hex digits")])
def test_a_bad_tag_is_named(bad, message):
    with pytest.raises(ValueError, match=f"job tag '{bad}' {message}"):
        Owned(bad)


def test_a_bad_file_kind_is_named():
    with pytest.raises(ValueError, match="weight file kind 'ckpt' is not one of"):
        Owned(LIVE).weight_file("ckpt", 1, "x")


@pytest.mark.parametrize("name, parsed", [
    ("areal-weights-0123abcd-42-0.bin", ("0123abcd", 42)),
    ("areal-vllm-0123abcd-9-cafe.safetensors", ("0123abcd", 9)),
    ("areal-weights-0123abcd-0.bin", None),           # no pid: not ours to judge
    ("areal-weights-5f3a9c01be77-0.bin", None),        # unowned (benchmarks, tests, older runs)
    ("areal-vllm-5f3a9c01be7745aa9d01c2e3f4a5b6c7.safetensors", None),
    ("areal-weights-0123ABCD-42-0.bin", None),
    ("areal-other-0123abcd-42-0.bin", None),
    ("pymp-xyz", None),
])
def test_weight_file_names(name, parsed):
    assert parse_weight_file(name) == parsed


def test_live_tags_come_from_driver_actors_only():
    names = ["areal-driver-0123abcd", "areal-driver-nothex!!", "SERVE_CONTROLLER_ACTOR",
             "areal-rollout-deadbeef", "areal-driver-0123abcd5"]
    assert live_tags(names) == {LIVE}


def test_stale_apps_are_ours_whose_driver_is_gone():
    apps = ["areal-rollout-deadbeef", "areal-rollout-0123abcd", "someone-elses-app",
            "areal-rollout-notatag"]
    assert stale_apps(apps, frozenset({LIVE})) == ["areal-rollout-deadbeef"]
    assert stale_apps(apps, frozenset({LIVE, DEAD})) == []


PIDS_ALIVE = {100, 300}
FILES = [  # (name, removed by another job's sweep, removed by the owner's own sweep)
    (f"areal-weights-{DEAD}-100-0.bin", True, True),   # dead job, writer alive (pid reused)
    (f"areal-weights-{DEAD}-200-1.bin", True, True),   # dead job
    (f"areal-weights-{LIVE}-100-0.bin", False, False),  # live job, live writer
    (f"areal-weights-{LIVE}-200-0.bin", False, False),  # live job, dead writer: its own business
    (f"areal-weights-{ME}-300-0.bin", False, False),    # the sweeping job's live trainer
    (f"areal-weights-{ME}-200-0.bin", False, True),     # the sweeping job's earlier trainer
    (f"areal-vllm-{ME}-200-ab.safetensors", False, True),  # a replica killed mid-load
    ("areal-weights-5f3a9c01be77-0.bin", False, False),  # unowned
    ("unrelated.bin", False, False),
]


@pytest.mark.parametrize("own_tag, column", [("", 1), (ME, 2)])
def test_stale_files(own_tag, column):
    live = frozenset({LIVE, ME})
    expect = sorted(row[0] for row in FILES if row[column])
    assert stale_files([r[0] for r in FILES], live, PIDS_ALIVE.__contains__, own_tag) == expect


def test_pg_cleaners_of_dead_jobs_only():
    actors = [Actor("a1", "PlacementGroupCleaner", "01000000", "ALIVE"),   # its job died
              Actor("a2", "PlacementGroupCleaner", "02000000", "ALIVE"),   # its job runs
              Actor("a3", "PlacementGroupCleaner", "01000000", "DEAD"),
              Actor("a4", "TrainController", "01000000", "ALIVE"),
              Actor("a5", "PlacementGroupCleaner", "", "ALIVE")]           # job unknown
    assert stale_pg_cleaners(actors, frozenset({"02000000"})) == ["a1"]
