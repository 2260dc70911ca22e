"""The job's node (cluster/home.py): the run's own parts are pinned there, so a lost
rollout node takes none of them.

The options; then Ray's scheduler on two
raylets of their own, the head's CPUs half taken (as a trainer takes them): the real
driver actor and a zero-CPU Ray Data actor pool, pinned, run on the head only (left to
Ray, the busy head sends zero-CPU actors to the idle node, which may be the one lost)."""

import json
import os
import subprocess
import sys

import pytest
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_ray.cluster.home import near_node, on_node


def test_on_node_is_a_hard_affinity_and_empty_for_no_node():
    node = "2c9e4b22be6ddfe4825d8cd27d27e34bb53715d86a3fcf40a5fee769"  # as Ray writes one
    strategy = on_node(node)["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy)
    assert (strategy.node_id, strategy.soft) == (node, False)
    assert on_node("") == {}
    assert near_node(node)["scheduling_strategy"].soft and near_node("") == {}


# Two raylets of their own (ray.cluster_utils.Cluster), in a process of its own; the
# head's one CPU of two held by an actor, as a trainer worker holds it.
TWO_NODES = """
import json, sys, ray
from ray.cluster_utils import Cluster
from ray.data import ActorPoolStrategy
from areal_ray.cluster.home import job_node, on_node
from areal_ray.driver import Driver
pin = json.loads(sys.argv[1])
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
c.add_node(num_cpus=2)
ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
c.wait_for_nodes()
home = job_node()
opts = on_node(home) if pin else {}

@ray.remote(num_cpus=1)
class Busy:
    pass

busy = Busy.options(**on_node(home)).remote()
ray.get(busy.__ray_ready__.remote())
here = lambda self: ray.get_runtime_context().get_node_id()
drivers = [Driver.options(**opts).remote(eta=1, batch_groups=1) for _ in range(6)]
ran = ray.get([d.__ray_call__.remote(here) for d in drivers])

class NodeOf:
    def __call__(self, batch):
        return {"node": [ray.get_runtime_context().get_node_id()] * len(batch["id"])}

ds = ray.data.range(8, override_num_blocks=8).map_batches(
    NodeOf, batch_size=None, num_cpus=0, compute=ActorPoolStrategy(size=4), **opts)
staged = sorted({r["node"] for r in ds.iter_rows()})
print(json.dumps({"home": home, "drivers": sorted(set(ran)), "stage": staged,
                  "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}))
ray.shutdown()
c.shutdown()
"""


def on_two_nodes(pin: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", TWO_NODES, json.dumps(pin)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.ray  # two raylets of its own (tests/conftest.py: the ray tier)
def test_the_driver_and_a_zero_cpu_stage_stay_on_the_busy_job_node():
    got = on_two_nodes(pin=True)
    assert len(got["nodes"]) == 2 and got["home"] in got["nodes"]
    assert got["drivers"] == [got["home"]] and got["stage"] == [got["home"]], got
