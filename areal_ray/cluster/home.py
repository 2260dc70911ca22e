"""The job's node: where the run's own parts live, so that losing another node costs
the run only what was placed there on purpose (replicas, trainer workers).

Ray places an actor or task with no node requirement on any node that can take it,
and a zero-CPU one on any node at all. The driver actor, the prompt reads and the
rollout and teacher stages of the Ray Data pipeline hold the run's state (the staleness
gate, the weight publications, admitted tickets): one of them lost with a rollout node
ends the run. A *soft* node affinity did not keep the driver on the job's node (Ray
leased it there, then spilled it back to the other node), so they are pinned hard: a
zero-CPU part can always be placed on the job's node. Ray Train's controller and Ray
Data's split coordinator already run there (Ray pins each to its creator's node).

The reward pool asks for CPUs, so it only prefers the job's node (a soft affinity):
pinned, it would wait forever on a job's node whose CPUs the trainer and replicas took
(the planner places it anywhere). It holds no state a lost node could take with it: Ray
Data gives the pool's actors max_restarts=-1 and max_task_retries=-1, so one lost with
its node is restarted and its calls retried (read in Ray 2.60's
actor_pool_map_operator.py; not measured here).
"""

from __future__ import annotations

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def on_node(node_id: str) -> dict:
    """Ray options that put an actor, task or Ray Data stage on node `node_id` and
    nowhere else (waiting for its resources there); {} for "" (Ray chooses)."""
    if not node_id:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def near_node(node_id: str) -> dict:
    """Ray options that prefer node `node_id` and fall back to any other that can take
    the work; {} for "" (Ray chooses)."""
    if not node_id:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}


def job_node() -> str:
    """This process's Ray node: the job's (Ray connects a job to the head node when
    several nodes share the host)."""
    import ray
    return ray.get_runtime_context().get_node_id()
