"""The placement and memory plan (areal_ray/cluster/plan.py) and `jobs.plan`: Ray's
packing rules, table by table, and each GPU's figures against the memory model."""

import json

import pytest
from transformers import AutoConfig

from areal_ray.cluster.placement import PlacementError, check_placement
from areal_ray.cluster.plan import (
    REPLICA,
    REWARD,
    TRAINER,
    Demand,
    Node,
    cluster_shape,
    demands,
    engine_gib,
    memory_plan,
    place,
    sharing_error,
)
from areal_ray.config import load_config
from areal_ray.train.memory import GIB, DecoderShape, trainer_memory
from jobs import plan as plan_job

QWEN = "conf/models/qwen2.5-1.5b.json"


@pytest.fixture(scope="module")
def qwen() -> DecoderShape:
    return DecoderShape.from_hf(AutoConfig.from_pretrained(QWEN))


def node(cpus=16, gpus=1, name="n0"):
    return Node(name, cpus, gpus, 80.0)


@pytest.mark.parametrize("needs, nodes, fits, gpus", [
    # two halves share one GPU
    ([Demand(REPLICA, 2, 0.5, 1), Demand(TRAINER, 4, 0.5, 1)], [node()], True, [(0,), (0,)]),
    # 0.6 + 0.5 cannot share a GPU: the second takes the next one, or fails without one
    ([Demand(REPLICA, 1, 0.6, 1), Demand(TRAINER, 1, 0.5, 1)], [node(gpus=2)], True, [(0,), (1,)]),
    ([Demand(REPLICA, 1, 0.6, 1), Demand(TRAINER, 1, 0.5, 1)], [node(gpus=1)], False, [(0,)]),
    # a fraction never spans two GPUs, even with a whole GPU's worth left in pieces
    ([Demand(REPLICA, 1, 0.6, 2), Demand(TRAINER, 1, 0.8, 1)], [node(gpus=2)], False, [(0,), (1,)]),
    # whole GPUs: 2 replicas + 2 trainers need 4
    ([Demand(REPLICA, 2, 1, 2), Demand(TRAINER, 4, 1, 2)], [node(gpus=4)], True,
     [(0,), (1,), (2,), (3,)]),
    ([Demand(REPLICA, 2, 1, 2), Demand(TRAINER, 4, 1, 2)], [node(gpus=1)], False, [(0,)]),
    # a multi-GPU replica (tensor parallel) takes whole GPUs on one node only
    ([Demand(REPLICA, 1, 2, 1)], [node(gpus=1, name="a"), node(gpus=1, name="b")], False, []),
    ([Demand(REPLICA, 1, 2, 1)], [node(gpus=1, name="a"), node(gpus=2, name="b")], True, [(0, 1)]),
    # CPUs run out before GPUs
    ([Demand(TRAINER, 4, 0, 2), Demand(REWARD, 0.25, 0, 1)], [node(cpus=8, gpus=0)], False, [(), ()]),
    # a fraction goes to the GPU it leaves least free (best fit): the third to GPU 1 (0.3
    # left), where first fit took GPU 0 and left no room for the fourth
    ([Demand(REPLICA, 0, 0.5, 1), Demand(REPLICA, 0, 0.7, 1), Demand(TRAINER, 0, 0.3, 1),
      Demand(REWARD, 0, 0.5, 1)], [node(gpus=2)], True, [(0,), (1,), (1,), (0,)]),
    # equals: the lowest index; so halves fill GPU 0 before GPU 1 is touched, and two
    # replicas and two trainer workers at 0.5 on two GPUs pair up by role, not 1 + 1
    ([Demand(REPLICA, 2, 0.5, 2), Demand(TRAINER, 4, 0.5, 2)], [node(gpus=2)], True,
     [(0,), (0,), (1,), (1,)]),
    ([Demand(REPLICA, 0, 0.25, 1), Demand(TRAINER, 0, 0.5, 1), Demand(REWARD, 0, 0.25, 1)],
     [node(gpus=3)], True, [(0,), (0,), (0,)]),
])
def test_place_follows_rays_packing(needs, nodes, fits, gpus):
    p = place(needs, nodes)
    assert p.fits is fits
    assert [s.gpus for s in p.slots] == gpus


VLLM_1GPU, SGLANG_1GPU = "conf/gsm8k_qwen_1gpu_vllm.yaml", "conf/gsm8k_qwen_1gpu.yaml"
TWO_EACH = ["rollout.min_replicas=2", "rollout.max_replicas=2", "train.num_workers=2"]


@pytest.mark.parametrize("conf, gpus, overrides, rules", [
    # the shipped one-GPU layouts start
    (VLLM_1GPU, 1, [], []),
    (SGLANG_1GPU, 1, [], []),
    # their two-GPU extension: Ray pairs the replicas on GPU 0 and the trainers on GPU 1
    (VLLM_1GPU, 2, TWO_EACH, ["engine shares per GPU: node0 GPU 0", "NCCL ranks per GPU: node0 GPU 1"]),
    (SGLANG_1GPU, 2, TWO_EACH, ["engine shares per GPU: node0 GPU 0", "NCCL ranks per GPU: node0 GPU 1"]),
    # whole-GPU trainers, two replicas sharing GPU 0: 2 x 0.45 + 0.1 fits, 2 x 0.5 does not
    (VLLM_1GPU, 3, TWO_EACH + ["train.num_gpus_per_worker=1",
                               "rollout.engine_kwargs.gpu_memory_utilization=0.45"], []),
    (VLLM_1GPU, 3, TWO_EACH + ["train.num_gpus_per_worker=1"], ["engine shares per GPU: node0 GPU 0"]),
    # one engine beside a trainer worker: its share and the margin must leave room
    (SGLANG_1GPU, 1, ["rollout.engine_kwargs.mem_fraction_static=0.95"],
     ["engine shares per GPU: node0 GPU 0"]),
    # an engine alone on its GPU may take what it likes
    (VLLM_1GPU, 2, ["rollout.num_gpus=1", "train.num_gpus_per_worker=1",
                    "rollout.engine_kwargs.gpu_memory_utilization=0.95"], []),
    # two trainer workers on a GPU of their own still cannot share it
    (VLLM_1GPU, 2, ["rollout.num_gpus=1", "train.num_workers=2"], ["NCCL ranks per GPU: node0 GPU 1"]),
    # the hf engine preallocates nothing: only the trainers' rule applies
    (VLLM_1GPU, 2, TWO_EACH + ["rollout.backend=hf", "rollout.engine_kwargs={}"],
     ["NCCL ranks per GPU: node0 GPU 1"]),
])
def test_placements_that_cannot_start_are_refused_by_rule(conf, gpus, overrides, rules):
    cfg = load_config(conf, overrides)
    nodes = cluster_shape(1, 16, gpus, 80)
    p = place(demands(cfg), nodes)
    assert p.fits
    why = sharing_error(cfg, p)
    if not rules:
        assert why is None, why
        check_placement(cfg, nodes=nodes)
        return
    assert why is not None and all(r in why for r in rules), why
    assert ("NCCL ranks" in why) == any("NCCL" in r for r in rules)
    assert ("engine shares" in why) == any("engine" in r for r in rules)
    if "NCCL" in why:
        assert "Duplicate GPU detected" in why
    if "engine shares" in why:  # the engine's own start-up rule, and what to change
        assert ("request_memory" if cfg.rollout.backend == "vllm" else "mem_fraction_static x the "
                "memory it finds free") in why
    if gpus > 1:
        assert "fractional sharing is for one GPU per node" in why
    with pytest.raises(PlacementError, match="cannot start"):
        check_placement(cfg, nodes=nodes)


def test_a_gpu_of_several_engines_is_checked_for_memory(qwen):
    cfg = load_config(VLLM_1GPU, TWO_EACH + ["train.num_gpus_per_worker=1"])
    p = place(demands(cfg), cluster_shape(1, 16, 3, 80))
    mem = memory_plan(cfg, qwen, p, 80)
    (shared,) = [g for g in mem["gpus"] if len(g["on"]) == 2]
    assert shared["gib"]["generate"] == 80 and not shared["fits"] and not mem["fits"]
    ok = load_config(VLLM_1GPU, TWO_EACH + ["train.num_gpus_per_worker=1",
                                            "rollout.engine_kwargs.gpu_memory_utilization=0.4"])
    assert memory_plan(ok, qwen, p, 80)["fits"]


def test_one_gpu_configs_share_one_gpu_and_fit_80_gib(qwen):
    for conf in ("conf/gsm8k_qwen_1gpu.yaml", "conf/gsm8k_qwen_1gpu_vllm.yaml"):
        cfg = load_config(conf, [])
        p = place(demands(cfg), cluster_shape(1, 16, 1, 80))
        assert p.fits and list(p.sharing()) == [("node0", 0)]
        assert {s.role for s in p.sharing()[("node0", 0)]} == {REPLICA, TRAINER}
        mem = memory_plan(cfg, qwen, p, 80)
        assert mem["fits"], mem
        # the step phase holds the released engine, the generate phase the trainer's state
        t = trainer_memory(qwen, cfg.algo.microbatch.max_tokens, 1, checkpointing=True)
        e = engine_gib(cfg, qwen, 80)
        assert mem["gpus"][0]["gib"]["step"] == pytest.approx(e["asleep"] + t.total / GIB, abs=0.02)
        assert mem["gpus"][0]["gib"]["generate"] == pytest.approx(e["awake"] + t.resident / GIB, abs=0.02)
        # without the release both are there at the step's peak: no longer fits
        keep = load_config(conf, ["rollout.release_memory=false"])
        assert not memory_plan(keep, qwen, p, 80)["fits"]
        # and a 40 GiB GPU cannot hold the fp32-master trainer of 1.5B next to an engine
        assert not memory_plan(cfg, qwen, p, 40)["fits"]


@pytest.mark.parametrize("nodes, gpus, overrides, workers", [
    (1, 4, [], 2),  # the shipped 4-GPU layout
    (2, 8, ["rollout.min_replicas=8", "rollout.max_replicas=8", "train.num_workers=8"], 8),
])
def test_whole_gpu_layouts_match_the_trainer_memory_model(qwen, nodes, gpus, overrides, workers):
    cfg = load_config("conf/gsm8k_qwen_sglang.yaml", overrides)
    p = place(demands(cfg), cluster_shape(nodes, 32, gpus, 40))
    assert p.fits
    used = p.sharing()
    assert len(used) == nodes * gpus and all(len(s) == 1 for s in used.values())
    mem = memory_plan(cfg, qwen, p, 40)
    t = trainer_memory(qwen, 10240, workers, checkpointing=True)
    trainer_gpus = [g for g in mem["gpus"] if g["on"][0].startswith(TRAINER)]
    assert len(trainer_gpus) == workers
    for g in trainer_gpus:
        assert g["gib"] == {"generate": round(t.resident / GIB, 2), "step": round(t.total / GIB, 2)}
    assert mem["fits"]


def test_plan_job_exit_status_and_message(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_job.main(["--config", "conf/gsm8k_qwen_1gpu.yaml", f"model_config={QWEN}",
                          f"out={out}"]) == 0
    assert json.loads(out.read_text())["fits"] is True
    assert "node0 GPU 0: rollout replica 0 (0.5), trainer worker 0 (0.5)" in capsys.readouterr().out
    # the 4-GPU config on one GPU: refused, naming what it asks and what there is
    assert plan_job.main(["--config", "conf/gsm8k_qwen_sglang.yaml", f"model_config={QWEN}",
                          "gpus=1"]) == 1
    text = capsys.readouterr().out
    assert "asks for 4 GPU" in text and "the cluster has 1 GPU" in text
    # a run key overrides the config; a missing model config is bad input
    assert plan_job.main(["--config", "conf/gsm8k_qwen_sglang.yaml", f"model_config={QWEN}",
                          "gpus=1", "rollout.min_replicas=1", "rollout.max_replicas=1",
                          "train.num_workers=1", "rollout.num_gpus=0.5",
                          "train.num_gpus_per_worker=0.5", "gpu_memory_gib=80"]) == 1  # no release
    assert "rollout.release_memory=true" in capsys.readouterr().out
    assert plan_job.main(["--config", "conf/gsm8k_qwen_1gpu.yaml"]) == 2
    assert "model_config=" in capsys.readouterr().err
    # the one-GPU config stretched to two GPUs: placed as Ray would, refused by rule
    assert plan_job.main(["--config", VLLM_1GPU, f"model_config={QWEN}", "gpus=2", *TWO_EACH]) == 1
    text = capsys.readouterr().out
    assert "node0 GPU 1: trainer worker 0 (0.5), trainer worker 1 (0.5)" in text
    assert "Sharing a GPU is a layout for one-GPU nodes" in text
    assert "NCCL ranks per GPU" in text and "verdict: does not fit" in text
    # several nodes: the listing is one of Ray's choices, and the run dir must be shared
    assert plan_job.main(["--config", "conf/gsm8k_qwen_sglang.yaml", f"model_config={QWEN}",
                          "nodes=2", "gpus=4", "gpu_memory_gib=80"]) == 0
    assert "run.run_dir must be storage every node mounts" in capsys.readouterr().out
