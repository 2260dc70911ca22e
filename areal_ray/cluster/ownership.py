"""What a job owns on a shared cluster, named from its tag, and which of it is garbage.

A killed job (SIGKILL, a lost node, an OOM kill) runs no `finally`, and three things it
made outlive it: its rollout Serve app (Serve's controller is detached, so an app lives
until someone deletes it, with its replicas' CPUs/GPUs and routes), its weight files in
/dev/shm (a file lives until unlinked: twice the model for the trainer's two slots),
and the detached `PlacementGroupCleaner` that Ray Train starts per controller, which
polls forever when Ray's state API does not answer (a cluster without a dashboard).
The trainer's placement group itself is not ours to remove: Ray removes a
non-detached group once its creator job and creator actor are both dead, and the
state API does not say which actor created a group (Serve's detached controller
creates groups too), so no rule of ours could tell a leaked one safely.

So every such resource carries the job's *tag* in its name, and the job's driver actor
(`areal-driver-<tag>`, non-detached: Ray ends it with the job's process) is the owner
record: a tag without a live driver actor belongs to a dead job, and what notices first
removes what it owned: the job's own rollout replicas, whose calls to the driver fail the
moment it dies (`cleanup.reap`, within seconds and with nobody's help), else the next
job's start-up sweep or `python -m jobs.cleanup` (a cluster that died with the job). Weight
files also carry the writer's pid, so a restarted trainer of a live job removes the
files of the incarnation before it, and the cluster's GCS port: several clusters on one
machine share its /dev/shm (a dev box, parallel CI), and only the cluster whose actors
are asked can say whether a tag is alive, so a sweep judges its own cluster's files
only. A vLLM engine's IPC socket dir is named the same way; a reward check's program dir
carries only its maker's pid (a check removes its own; only a killed process leaves one). (Files of a cluster that is gone altogether stay until a cluster on that port
sweeps, or `ray stop` and a reboot.)

The decisions are here, pure and table-tested; `areal_ray/cluster/cleanup.py` looks at
the cluster and acts. One rule for every decision: what is read about owners is read
*after* the resources are listed, so a job that starts during a sweep (its driver is
created before its app and its files) is never mistaken for a dead one.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DRIVER_PREFIX = "areal-driver-"
APP_PREFIX = "areal-rollout-"
# The served rewards' apps (deployments/judge.py), one per kind, and the distillation
# teacher's (deployments/teacher.py), owned alike
SERVED_APP_PREFIXES = {"judge": "areal-judge-", "reward_model": "areal-rm-", "teacher": "areal-teacher-"}
# The trainer's shm slots; a vLLM replica's staged file; a vLLM engine's directory of
# ZMQ IPC sockets (VLLM_RPC_BASE_PATH, in the temp dir): each named as Owned.weight_file
FILE_KINDS = ("weights", "vllm", "ipc")
SANDBOX_PREFIX = "areal-sandbox-"  # a reward check's program dir (reward/sandbox.py)
_TAG = r"[0-9a-f]{8}"
_FILE = re.compile(rf"^areal-({'|'.join(FILE_KINDS)})-(\d+)-({_TAG})-(\d+)-[^/]+$")
_SANDBOX = re.compile(rf"^{SANDBOX_PREFIX}(\d+)-[^/]+$")
PG_CLEANER_CLASS = "PlacementGroupCleaner"  # Ray Train v2's detached per-controller cleaner


def new_tag() -> str:
    return uuid.uuid4().hex[:8]


@dataclass(frozen=True)
class Owned:
    """The names of what the job tagged `tag` creates."""
    tag: str

    def __post_init__(self):
        if not re.fullmatch(_TAG, self.tag):
            raise ValueError(f"job tag {self.tag!r} is not 8 lowercase hex digits")

    @property
    def driver_name(self) -> str:
        return DRIVER_PREFIX + self.tag

    @property
    def app_name(self) -> str:
        return APP_PREFIX + self.tag

    def served_app_name(self, kind: str) -> str:
        """The app of served reward `kind` (judge, reward_model)."""
        return SERVED_APP_PREFIXES[kind] + self.tag

    @property
    def app_names(self) -> list[str]:
        """Every Serve app the job may own: the rollout app and the served rewards'."""
        return [self.app_name, *(p + self.tag for p in SERVED_APP_PREFIXES.values())]

    def extra_apps(self, live) -> list[str]:
        """The job's apps beside its rollout app (the served rewards', the teacher's)
        among `live` app names: each exists only where the run had one."""
        return [a for a in self.app_names[1:] if a in live]

    def weight_file(self, kind: str, cluster: int, pid: int, rest: str) -> str:
        """The name of a weight file written by process `pid` of the cluster whose GCS
        listens on port `cluster`; `rest` tells a writer's files apart (a slot, a uuid)
        and ends with the extension."""
        if kind not in FILE_KINDS:
            raise ValueError(f"weight file kind {kind!r} is not one of {FILE_KINDS}")
        return f"areal-{kind}-{cluster}-{self.tag}-{pid}-{rest}"


def _tag_after(prefix: str, name: str) -> str | None:
    tag = name[len(prefix):] if name.startswith(prefix) else ""
    return tag if re.fullmatch(_TAG, tag) else None


def tag_of_driver(name: str) -> str | None:
    return _tag_after(DRIVER_PREFIX, name)


def tag_of_app(name: str) -> str | None:
    return next((t for p in (APP_PREFIX, *SERVED_APP_PREFIXES.values())
                 if (t := _tag_after(p, name))), None)


def cluster_of(gcs_address: str) -> int:
    """A cluster's id among those sharing a machine: its GCS port (the same whether a
    process reached it as 127.0.0.1 or by the node's address)."""
    host, sep, port = gcs_address.rpartition(":")
    if not (sep and port.isdigit()):
        raise ValueError(f"GCS address {gcs_address!r} is not host:port")
    return int(port)


def parse_weight_file(name: str) -> tuple[int, str, int] | None:
    """(cluster, tag, writer pid) of one of our weight files; None for any other name
    (files of other programs, and ours from before files carried an owner, are never
    touched)."""
    m = _FILE.match(name)
    return (int(m[2]), m[3], int(m[4])) if m else None


def live_tags(named_actors: Iterable[str]) -> frozenset[str]:
    """Tags whose driver actor is alive, from the names of the cluster's live actors."""
    return frozenset(t for n in named_actors if (t := tag_of_driver(n)))


def stale_apps(apps: Iterable[str], live: frozenset[str]) -> list[str]:
    """Our rollout apps whose job is gone; apps of other names are not ours."""
    return sorted(a for a in apps if (t := tag_of_app(a)) and t not in live)


def stale_files(names: Iterable[str], cluster: int, live: frozenset[str],
                pid_alive: Callable[[int], bool], own_tag: str = "") -> list[str]:
    """Our weight files to remove on one node of `cluster` (`live`: its live tags):
    those of a dead job, and those of the sweeping job (`own_tag`) whose writer died
    (an earlier trainer incarnation, a replica killed mid-load). A live *other* job's
    files stay even when their writer is dead: that job may still be publishing them
    and removes them itself. Another cluster's files are not this one's to judge."""
    out = []
    for n in names:
        if (parsed := parse_weight_file(n)) is None or parsed[0] != cluster:
            continue
        _, tag, pid = parsed
        if tag not in live or (tag == own_tag and not pid_alive(pid)):
            out.append(n)
    return sorted(out)


def owned_by(names: Iterable[str], tag: str) -> list[str]:
    """The names of `names` that the job tagged `tag` owns: what an owner watch removes
    once that job's driver is gone (and nothing of another job, dead or alive)."""
    out = []
    for n in names:
        if (t := tag_of_app(n)) is None and (parsed := parse_weight_file(n)) is not None:
            t = parsed[1]
        if t == tag:
            out.append(n)
    return sorted(out)


def sandbox_dir_prefix(pid: int) -> str:
    """The prefix of a reward check's program dir made by process `pid`: the pid lets a
    sweep tell the dir of a killed reward process from one of a check still running."""
    return f"{SANDBOX_PREFIX}{pid}-"


def stale_sandbox_dirs(names: Iterable[str], pid_alive: Callable[[int], bool]) -> list[str]:
    """Reward-check dirs of this node whose maker is dead: a check removes its own dir
    when it ends (a `finally`), so one is left only by a killed reward process. Dirs
    without a pid (another program's, or older ones) are not ours to judge."""
    return sorted(n for n in names if (m := _SANDBOX.match(n)) and not pid_alive(int(m[1])))


@dataclass(frozen=True)
class Actor:
    id: str
    class_name: str
    job_id: str
    state: str


def stale_pg_cleaners(actors: Iterable[Actor], live_jobs: frozenset[str]) -> list[str]:
    """Ray Train's detached placement-group cleaners whose job is gone: their controller
    (non-detached, of that job) is dead too, so there is nothing left for them to do."""
    return sorted(a.id for a in actors if a.class_name == PG_CLEANER_CLASS
                  and a.state == "ALIVE" and a.job_id and a.job_id not in live_jobs)
