"""The placement and memory plan (areal_ray/cluster/plan.py) and `jobs.plan`: Ray's
packing rules, table by table, and each GPU's figures against the memory model."""

import json

import pytest
from transformers import AutoConfig

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
])
def test_place_follows_rays_packing(needs, nodes, fits, gpus):
    p = place(needs, nodes)
    assert p.fits is fits
    assert [s.gpus for s in p.slots] == gpus


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
