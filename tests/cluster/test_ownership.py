"""Which resources of which jobs a sweep removes (areal_ray/cluster/ownership.py), table by
table, without Ray; `tests/jobs/test_cleanup.py` kills a real job on a `ray start` cluster."""

import pytest

from areal_ray.cluster.ownership import (
    Actor,
    Owned,
    cluster_of,
    live_tags,
    new_tag,
    owned_by,
    parse_weight_file,
    sandbox_dir_prefix,
    stale_apps,
    stale_files,
    stale_pg_cleaners,
    stale_sandbox_dirs,
    tag_of_app,
    tag_of_driver,
)

DEAD, LIVE, ME = "deadbeef", "0123abcd", "feedf00d"


def test_a_tag_names_everything_its_job_owns():
    o = Owned(LIVE)
    assert (o.driver_name, o.app_name) == ("areal-driver-0123abcd", "areal-rollout-0123abcd")
    assert o.weight_file("weights", 6379, 42, "0.bin") == "areal-weights-6379-0123abcd-42-0.bin"
    assert tag_of_driver(o.driver_name) == tag_of_app(o.app_name) == LIVE
    assert parse_weight_file(o.weight_file("vllm", 6379, 7, "ab12.safetensors")) == (6379, LIVE, 7)
    assert Owned(new_tag()).tag != Owned(new_tag()).tag


@pytest.mark.parametrize("bad, message", [
    ("ABCDEF12", "is not 8 lowercase hex digits"), ("abc", "is not 8 lowercase hex digits"),
    ("0123abcd-x", "is not 8 lowercase hex digits")])
def test_a_bad_tag_is_named(bad, message):
    with pytest.raises(ValueError, match=f"job tag '{bad}' {message}"):
        Owned(bad)


def test_a_bad_file_kind_is_named():
    with pytest.raises(ValueError, match="weight file kind 'ckpt' is not one of"):
        Owned(LIVE).weight_file("ckpt", 6379, 1, "x")


def test_the_cluster_is_its_gcs_port_however_it_was_reached():
    assert cluster_of("127.0.0.1:6379") == cluster_of("10.0.0.5:6379") == 6379
    with pytest.raises(ValueError, match="GCS address 'auto' is not host:port"):
        cluster_of("auto")


@pytest.mark.parametrize("name, parsed", [
    ("areal-weights-6379-0123abcd-42-0.bin", (6379, "0123abcd", 42)),
    ("areal-vllm-6379-0123abcd-9-cafe.safetensors", (6379, "0123abcd", 9)),
    ("areal-ipc-6379-0123abcd-9-vllm", (6379, "0123abcd", 9)),  # a vLLM engine's socket dir
    ("areal-weights-0123abcd-42-0.bin", None),        # no cluster: not ours to judge
    ("areal-weights-5f3a9c01be77-0.bin", None),        # unowned (benchmarks, tests, older runs)
    ("areal-vllm-5f3a9c01be7745aa9d01c2e3f4a5b6c7.safetensors", None),
    ("areal-weights-6379-0123ABCD-42-0.bin", None),
    ("areal-other-6379-0123abcd-42-0.bin", None),
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
C, OTHER_C = 6379, 6380  # the sweeping cluster, another one on the same machine
FILES = [  # (name, removed by another job's sweep, removed by the owner's own sweep)
    (f"areal-weights-{C}-{DEAD}-100-0.bin", True, True),   # dead job, writer alive (pid reused)
    (f"areal-weights-{C}-{DEAD}-200-1.bin", True, True),   # dead job
    (f"areal-weights-{C}-{LIVE}-100-0.bin", False, False),  # live job, live writer
    (f"areal-weights-{C}-{LIVE}-200-0.bin", False, False),  # live job, dead writer: its own business
    (f"areal-weights-{C}-{ME}-300-0.bin", False, False),    # the sweeping job's live trainer
    (f"areal-weights-{C}-{ME}-200-0.bin", False, True),     # the sweeping job's earlier trainer
    (f"areal-vllm-{C}-{ME}-200-ab.safetensors", False, True),  # a replica killed mid-load
    (f"areal-ipc-{C}-{DEAD}-100-vllm", True, True),         # a dead job's vLLM socket dir
    (f"areal-ipc-{C}-{LIVE}-200-vllm", False, False),       # a live job's
    (f"areal-weights-{OTHER_C}-{DEAD}-200-0.bin", False, False),  # another cluster's: not ours
    (f"areal-weights-{OTHER_C}-{ME}-200-0.bin", False, False),
    ("areal-weights-5f3a9c01be77-0.bin", False, False),  # unowned
    ("unrelated.bin", False, False),
]


@pytest.mark.parametrize("own_tag, column", [("", 1), (ME, 2)])
def test_stale_files(own_tag, column):
    live = frozenset({LIVE, ME})
    expect = sorted(row[0] for row in FILES if row[column])
    assert stale_files([r[0] for r in FILES], C, live, PIDS_ALIVE.__contains__, own_tag) == expect


def test_pg_cleaners_of_dead_jobs_only():
    actors = [Actor("a1", "PlacementGroupCleaner", "01000000", "ALIVE"),   # its job died
              Actor("a2", "PlacementGroupCleaner", "02000000", "ALIVE"),   # its job runs
              Actor("a3", "PlacementGroupCleaner", "01000000", "DEAD"),
              Actor("a4", "TrainController", "01000000", "ALIVE"),
              Actor("a5", "PlacementGroupCleaner", "", "ALIVE")]           # job unknown
    assert stale_pg_cleaners(actors, frozenset({"02000000"})) == ["a1"]


def test_an_owner_watch_takes_its_own_jobs_things_only():
    """What a dead job's replicas remove (cleanup.reap): everything named for their own
    tag, and nothing of another job, dead or alive, or of no job."""
    names = [f"areal-rollout-{DEAD}", f"areal-rollout-{LIVE}", f"areal-driver-{DEAD}",
             f"areal-weights-{C}-{DEAD}-100-0.bin", f"areal-ipc-{C}-{DEAD}-100-vllm",
             f"areal-vllm-{OTHER_C}-{DEAD}-7-x.safetensors", f"areal-weights-{C}-{ME}-200-0.bin",
             f"areal-weights-{C}-{LIVE}-100-0.bin", "areal-weights-5f3a9c01be77-0.bin",
             f"areal-sandbox-100-{DEAD}", "unrelated"]
    assert owned_by(names, DEAD) == [
        f"areal-ipc-{C}-{DEAD}-100-vllm", f"areal-rollout-{DEAD}",
        f"areal-vllm-{OTHER_C}-{DEAD}-7-x.safetensors", f"areal-weights-{C}-{DEAD}-100-0.bin"]
    assert owned_by(names, "0badf00d") == []


@pytest.mark.parametrize("name, removed", [
    (sandbox_dir_prefix(100) + "abc_12", False),   # its reward process still runs
    (sandbox_dir_prefix(200) + "abc_12", True),    # its reward process was killed
    ("areal-sandbox-abc_12", False),               # no pid: not ours to judge
    ("areal-sandbox-200", False),
    ("areal-weights-6379-0123abcd-200-0.bin", False),
    ("other-200-x", False),
])
def test_a_sandbox_dir_goes_when_its_maker_is_dead(name, removed):
    assert stale_sandbox_dirs([name], PIDS_ALIVE.__contains__) == ([name] if removed else [])
