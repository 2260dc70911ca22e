"""Ray settings of a local cluster the job starts: the system settings that bound Ray's
own memory, and its workers' environment (`local_worker_env`).

The GCS keeps an event record of every task and actor call for the dashboard and
`ray list tasks`, up to `task_events_max_num_task_in_gcs` (100,000 in Ray 2.60),
and once that is reached, the ids of the dropped attempts, up to
`task_events_max_dropped_task_attempts_tracked_per_job_in_gcs` (1,000,000). A run
makes a few hundred calls per step (the rollout stage's gate calls, Serve requests,
load reports, the trainer's and the job's polls), so `gcs_server` grew ~20 MiB per
100 quickstart steps until the cap, an estimated ~200 MiB (benchmarks.bench_soak; docs/architecture.md,
"Long runs"). `run.task_events_kept` caps the records at a size the newest of which still
cover the last minutes of a run, and the dropped ids at ten times that.

Ray Data's blocks are small here (one prompt, one group: a few KiB), and Ray returns a
task result under `max_direct_call_object_size` (100 KiB) inline, into the memory of
the process that owns it: for every block, Ray Data's coordinator
(`SplitCoordinator`). There the bytes of every block that passed through stayed: with
20 KB rows through two stages its memory grew 39 KiB per row (2 x 20 KB), and 7-12
KiB per row with the same blocks in the shared-memory object store, which was empty
at the end (Ray 2.60, measured in isolation: docs/architecture.md, "Long runs").
`run.inline_result_bytes` (1 KiB by default) sends anything larger than a gate call's
answer through the object store; that costs the quickstart ~8% of its steady
samples/s (Serve's responses take the same path), the price of a flat long run.

Only a cluster this job starts takes them (`ray.init(_system_config=...)`); a cluster
started with `ray start` reads them from `RAY_<name>` in the environment of
`ray start --head`.
"""

from __future__ import annotations

import os

DROPPED_TRACKED_PER_KEPT = 10


def system_config(run) -> dict:
    """The `_system_config` of a local cluster for the run section `run`."""
    return {"task_events_max_num_task_in_gcs": run.task_events_kept,
            "task_events_max_dropped_task_attempts_tracked_per_job_in_gcs":
                DROPPED_TRACKED_PER_KEPT * run.task_events_kept,
            "max_direct_call_object_size": run.inline_result_bytes}


def local_worker_env(repo_root: str, dashboard_port: int) -> dict[str, str]:
    """The environment of every worker of a local cluster this process starts.

    - `repo_root` first on PYTHONPATH: workers import the same checkout as this process.
    - RAY_API_SERVER_ADDRESS: Ray Train's PlacementGroupCleaner asks the state API
      whether the controller lives; without the dashboard's address each ask ran into
      a 10 s timeout (or found another cluster on the host), ~13 s at every job's end.
    - No preemption watcher: Ray Train starts one actor per run to poll whether a node
      is being drained (a spot instance taken back); one local node is never drained,
      and the actor's process cost ~2 CPU-seconds of every job's start on 2 cores.
      A cluster started with `ray start` (spot nodes, autoscaling) keeps it.
    """
    return {"PYTHONPATH": os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH", "")) if p),
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dashboard_port}",
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
