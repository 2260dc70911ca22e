"""Ray system settings of a local cluster the job starts: what bounds Ray's own memory.

The GCS keeps an event record of every task and actor call for the dashboard and
`ray list tasks`, up to `task_events_max_num_task_in_gcs` (100,000 in Ray 2.60),
and once that is reached, the ids of the dropped attempts, up to
`task_events_max_dropped_task_attempts_tracked_per_job_in_gcs` (1,000,000). A run
makes a few hundred calls per step (the rollout stage's gate calls, Serve requests,
load reports, the trainer's and the job's polls), so `gcs_server` grew ~20 MiB per
100 quickstart steps until the cap, ~200 MiB on (jobs.bench_soak; docs/data.md,
"Soak"). `run.task_events_kept` caps the records at a size the newest of which still
cover the last minutes of a run, and the dropped ids at ten times that.

Only a cluster this job starts takes them (`ray.init(_system_config=...)`); a cluster
started with `ray start` reads them from `RAY_<name>` in the environment of
`ray start --head`.
"""

from __future__ import annotations

DROPPED_TRACKED_PER_KEPT = 10


def system_config(run) -> dict:
    """The `_system_config` of a local cluster for the run section `run`."""
    return {"task_events_max_num_task_in_gcs": run.task_events_kept,
            "task_events_max_dropped_task_attempts_tracked_per_job_in_gcs":
                DROPPED_TRACKED_PER_KEPT * run.task_events_kept}

