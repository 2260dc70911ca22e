"""Roles on node types (cluster/roles.py): `rollout.resources` / `rollout.node_labels`
and `train.resources` / `train.node_labels` pin replicas and trainer workers to nodes.

Table-driven: label selectors as Ray reads them, the config's refusals, the planner's
placement on a cluster of typed nodes and its refusal naming the type no node has;
then Ray's own scheduler on a cluster of two raylets of their own (custom resources
and labels): each role lands on the node the planner put it on."""

import json
import os
import subprocess
import sys

import pytest

from areal_ray.cluster.placement import PlacementError, check_placement, nodes_of
from areal_ray.cluster.plan import REPLICA, TRAINER, Node, demands, place
from areal_ray.cluster.roles import NodeRequirement, selector_matches
from areal_ray.config import ConfigError, load_config


@pytest.mark.parametrize("selector,value,expected", [
    ("train", "train", True), ("train", "inference", False), ("train", None, False),
    ("!spot", "on-demand", True), ("!spot", "spot", False), ("!spot", None, True),
    ("in(a100, h100)", "h100", True), ("in(a100,h100)", "a100", True), ("in(a100, h100)", "l4", False),
    ("in(a100, h100)", None, False), ("!in(spot, preempt)", "spot", False),
    ("!in(spot, preempt)", "on-demand", True), ("!in(spot, preempt)", None, True),
])
def test_label_selectors_match_as_ray_reads_them(selector, value, expected):
    assert selector_matches(selector, value) is expected


@pytest.mark.parametrize("overrides,error", [
    (["rollout.resources={GPU: 1}"], r"rollout.resources.GPU: GPU is not a custom resource"),
    (["train.resources={node:10.0.0.1: 1}"], r"train.resources.node:10.0.0.1: .* not a custom resource"),
    (["train.resources={training: 0}"], r"train.resources.training must be a number > 0"),
    (["rollout.resources={inference: lots}"], r"rollout.resources.inference must be a number > 0"),
    (["rollout.node_labels={pool: 'in(a,'}"], r"rollout.node_labels: Invalid label selector value `in\(a,`"),
])
def test_a_role_ray_would_refuse_is_a_config_error(overrides, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)


def test_the_options_serve_and_ray_take():
    cfg = load_config(None, ["rollout.resources={inference: 1}", "rollout.node_labels={pool: inference}",
                             "train.resources={training: 0.5}", "train.node_labels={market: '!spot'}"])
    assert NodeRequirement.of(cfg.rollout).actor_options() == {
        "resources": {"inference": 1.0}, "label_selector": {"pool": "inference"}}
    from areal_ray.run.job import worker_resources
    assert worker_resources(cfg) == {"CPU": 1.0, "training": 0.5}
    assert NodeRequirement.of(load_config(None, []).rollout).actor_options() == {}  # unpinned: nothing


TYPED = [Node("gpu-a", 8, 0, resources={"inference": 4}, labels={"pool": "inference"}),
         Node("gpu-b", 8, 0, resources={"training": 4}, labels={"pool": "train"}),
         Node("cpu-c", 8, 0, labels={"pool": "cpu", "market": "spot"})]
PINNED = ["rollout.resources={inference: 1}", "rollout.min_replicas=2", "rollout.max_replicas=2",
          "train.node_labels={pool: train}", "train.num_workers=2"]


def test_each_role_is_placed_on_its_node_type():
    p = place(demands(load_config(None, PINNED)), TYPED)
    assert p.fits
    where = {(s.role, s.index): s.node for s in p.slots}
    assert [where[(REPLICA, i)] for i in range(2)] == ["gpu-a", "gpu-a"]
    assert [where[(TRAINER, i)] for i in range(2)] == ["gpu-b", "gpu-b"]
    # unpinned, the first node that fits takes them all
    assert {s.node for s in place(demands(load_config(None, [])), TYPED).slots} == {"gpu-a"}


@pytest.mark.parametrize("overrides,error", [
    (["rollout.resources={inference: 3}", "rollout.min_replicas=2", "rollout.max_replicas=2"],
     r"rollout replicas need nodes with inference=3: only gpu-a has them"),  # 6 of its 4
    (["train.resources={tpu: 1}"], r"trainer workers need nodes with tpu=1: no node has them "
                                   r"\(ray start --resources / --labels\); nodes: gpu-a \(inference=4, "
                                   r"labels pool=inference\); gpu-b"),
    (["train.node_labels={market: '!spot', pool: cpu}"], r"trainer workers need nodes with label "
                                                          r"market=!spot, label pool=cpu: no node"),
])
def test_a_role_no_node_can_host_is_refused_naming_its_type(overrides, error):
    with pytest.raises(PlacementError, match=error):
        check_placement(load_config(None, overrides), nodes=TYPED)


def test_ray_nodes_give_their_custom_resources_and_labels_and_raylets_of_one_machine_apart():
    info = {"NodeManagerAddress": "10.0.0.5", "NodeID": "ab12cd34ef", "Alive": True,
            "Resources": {"CPU": 4.0, "GPU": 1.0, "memory": 1e9, "object_store_memory": 1e8,
                          "node:10.0.0.5": 1.0, "accelerator_type:H100": 1.0, "inference": 2.0},
            "Labels": {"pool": "inference", "ray.io/node-id": "ab12cd34ef"}}
    (node,) = nodes_of([info])
    assert (node.name, node.cpus, node.gpus, node.resources) == ("10.0.0.5", 4.0, 1, {"inference": 2.0})
    assert node.labels["pool"] == "inference"
    twins = nodes_of([info, {**info, "NodeID": "99ff00ee11"}])
    assert [n.name for n in twins] == ["10.0.0.5 (ab12cd34)", "10.0.0.5 (99ff00ee)"]


# Two raylets on this machine (ray.cluster_utils.Cluster), in a process of its own: the
# head offers "training" and is labelled pool=train, the other "inference" and
# pool=inference. Each role's actors start with the options the job gives them and
# report the node Ray put them on; the planner places the same run on `ray.nodes()`.
TWO_NODES = """
import json, sys, ray
from ray.cluster_utils import Cluster
from areal_ray.cluster.placement import nodes_of
from areal_ray.cluster.plan import demands, place
from areal_ray.cluster.roles import NodeRequirement
from areal_ray.config import load_config
cfg = load_config(None, json.loads(sys.argv[1]))
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"training": 2},
                                                   "labels": {"pool": "train"}})
c.add_node(num_cpus=2, resources={"inference": 2}, labels={"pool": "inference"})
ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
c.wait_for_nodes()
infos = [n for n in ray.nodes() if n["Alive"]]
names = {n.name: i["NodeID"] for n, i in zip(nodes_of(infos), infos)}
planned = [[s.role, names[s.node]] for s in place(demands(cfg), nodes_of(infos)).slots]

@ray.remote(num_cpus=0)
class Holder:
    def node(self):
        return ray.get_runtime_context().get_node_id()

ran = []
for section, role, n in ((cfg.rollout, "rollout replica", cfg.rollout.min_replicas),
                         (cfg.train, "trainer worker", cfg.train.num_workers)):
    opts = NodeRequirement.of(section).actor_options()
    ran += [[role, ray.get(Holder.options(**opts).remote().node.remote())] for _ in range(n)]
print(json.dumps({"planned": [p for p in planned if p[0] != "reward actor"], "ran": ran}))
ray.shutdown()
c.shutdown()
"""


@pytest.mark.ray  # two raylets of its own (tests/conftest.py: the ray tier)
def test_rays_scheduler_puts_each_role_where_the_planner_does():
    overrides = ["rollout.resources={inference: 1}", "rollout.min_replicas=2", "rollout.max_replicas=2",
                 "train.node_labels={pool: train}", "train.num_workers=2", "rollout.num_cpus=0.5",
                 "train.num_cpus_per_worker=0.5", "reward.num_cpus=0.5"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", TWO_NODES, json.dumps(overrides)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ran"] == got["planned"]
    replicas = {node for role, node in got["ran"] if role == REPLICA}
    trainers = {node for role, node in got["ran"] if role == TRAINER}
    assert len(replicas) == len(trainers) == 1 and replicas != trainers
