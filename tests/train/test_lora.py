"""LoRA on the trainer (`model.lora`, areal_ray/train/lora.py): peft's adapter injected
before FSDP2 sharding on a real one-rank gloo group, so only the adapter trains and has
optimizer state; checkpoints hold and restore exactly the adapter and its optimizer
state; the exported model is plain HF (the merge every side computes) with the adapter
in peft's format beside it."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import load_config
from areal_ray.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, trainer_state
from areal_ray.train.fsdp import load_sharded_model
from areal_ray.train.lora import (
    ADAPTER_DIR,
    adapter_meta,
    adapter_state,
    base_weights,
    check_model_targets,
    check_targets,
    linear_names,
    save_lora_model,
    trainable_parameters,
)
from areal_ray.train.schedule import make_scheduler
from areal_ray.train.step import Models, train_step
from areal_ray.weights.adapter import Adapter
from tests.algo.test_packing import make_seqs
from tests.train.test_checkpoint import storage  # noqa: F401 - the fixture

LORA = ["model.lora.enabled=true", "weights.path=shm", "model.lora.rank=4", "model.lora.alpha=8",
        "algo.microbatch.max_tokens=64"]


def lora_cfg(*extra):
    return load_config(None, LORA + list(extra))


def build(model_dir: str, cfg) -> Models:
    policy = load_sharded_model(model_dir, lora=cfg.model.lora)
    opt = torch.optim.AdamW(trainable_parameters(policy), lr=1e-2)
    return Models(policy, opt, make_scheduler(opt, 10, 0, "constant"))


def step(m: Models, cfg, seed: int = 0) -> dict:
    seqs = [dict(s, ticket=t) for t in range(2) for s in make_seqs(3, seed=seed + t)]
    return train_step(m, seqs, cfg, 0, 0)


def test_a_missing_target_names_itself_and_the_linear_modules(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    # the tied output projection is not offered: merging into it would move the embeddings
    assert linear_names(model) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                   "up_proj", "v_proj"]
    with pytest.raises(ValueError, match=r"qkv_proj is not a linear module of Qwen2ForCausalLM; "
                                         r"its linear modules are: down_proj, gate_proj, k_proj"):
        check_targets(model, ["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="lm_head, wq are not linear modules"):
        check_model_targets(random_model_dir, ["lm_head", "wq"])  # config only, before Ray
    with pytest.raises(ValueError, match="query is not a linear module"):
        load_sharded_model(random_model_dir, lora=lora_cfg("model.lora.target_modules=[query]").model.lora)


def test_only_the_adapter_trains_and_has_optimizer_state(random_model_dir, one_rank_group):
    cfg = lora_cfg()
    m = build(random_model_dir, cfg)
    names = [n for n, p in m.policy.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # 7 targets x 2 layers, A and B each
    assert len(names) == 28 and len(adapter_state(m.policy)) == 28
    base = {k: v.clone() for k, v in base_weights(m.policy).items()}
    frozen = {n: p.full_tensor().clone() for n, p in m.policy.named_parameters() if not p.requires_grad}
    before = adapter_state(m.policy)
    stats = step(m, cfg)
    assert stats["grad_norm"] > 0
    state = m.opt.state_dict()["state"]
    trainable = trainable_parameters(m.policy)
    assert len(state) == len(trainable) == 28
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(p.numel() for p in trainable)
    assert sum(p.numel() for p in trainable) < sum(p.numel() for p in m.policy.parameters()) / 4
    after = adapter_state(m.policy)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # B moved off zero
    assert all(torch.equal(p.full_tensor(), frozen[n])
               for n, p in m.policy.named_parameters() if not p.requires_grad)
    assert all(torch.equal(base[k], v) for k, v in base_weights(m.policy).items())


def test_a_checkpoint_holds_and_restores_the_adapter_and_its_optimizer_state(
        random_model_dir, one_rank_group, storage):  # noqa: F811 - the fixture
    cfg = lora_cfg()
    a = build(random_model_dir, cfg)
    step(a, cfg)
    a.sched.step()
    meta = adapter_meta(a.policy, cfg.model.lora, random_model_dir, "float32")
    save_checkpoint(a, adapter_state(a.policy), trainer_state(1, 2, 2, [0, 1]), random_model_dir,
                    hf_model=True, adapter=meta)
    d = latest_checkpoint(storage.root)
    # the sharded state is the adapter's and its optimizer's: no base weight is in it
    from torch.distributed.checkpoint import FileSystemReader
    keys = list(FileSystemReader(str(d / "state")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("policy.model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert (d / "model" / ADAPTER_DIR / "adapter_config.json").is_file()

    torch.manual_seed(123)  # a fresh adapter's A is random: the load must overwrite it
    b = build(random_model_dir, cfg)
    assert any(not torch.equal(x, y) for x, y in zip(adapter_state(a.policy).values(),
                                                     adapter_state(b.policy).values()))
    load_checkpoint(b, d)
    assert adapter_state(a.policy).keys() == adapter_state(b.policy).keys()
    assert all(torch.equal(x, y) for x, y in zip(adapter_state(a.policy).values(),
                                                 adapter_state(b.policy).values()))
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) == 28
    for k in sa["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            x, y = sa["state"][k][field], sb["state"][k][field]
            x, y = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (x, y))
            assert torch.equal(x, y), (k, field)
    assert b.sched.state_dict() == a.sched.state_dict()
    # and the resumed run trains on exactly as the original does
    step(a, cfg, seed=7)
    step(b, cfg, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(adapter_state(a.policy).values(),
                                                 adapter_state(b.policy).values()))


def test_the_export_is_a_plain_merged_model_and_a_peft_adapter(random_model_dir, one_rank_group,
                                                               tmp_path):
    import peft
    cfg = lora_cfg()
    m = build(random_model_dir, cfg)
    step(m, cfg)
    adapter = Adapter(adapter_meta(m.policy, cfg.model.lora, random_model_dir, "float32"),
                      adapter_state(m.policy))
    out = save_lora_model(adapter, random_model_dir, tmp_path / "final_model")
    merged = AutoModelForCausalLM.from_pretrained(str(out))  # plain transformers
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    # peft's own merge of the same adapter, loaded from the saved folder: bit for bit
    base = AutoModelForCausalLM.from_pretrained(random_model_dir)
    loaded = peft.PeftModel.from_pretrained(base, str(out / ADAPTER_DIR))
    assert loaded.peft_config["default"].base_model_name_or_path == random_model_dir
    theirs = loaded.merge_and_unload().state_dict()
    ours = merged.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    # and it is the function the adapter computed in training
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        trained = m.policy(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, trained, atol=1e-5)
    changed = [k for k in ours if not torch.equal(ours[k], base_state(random_model_dir)[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)


def base_state(model_dir: str) -> dict:
    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def test_lora_off_builds_the_plain_model(random_model_dir):
    model = load_sharded_model(random_model_dir, lora=load_config(None, []).model.lora)
    assert all(p.requires_grad for p in model.parameters())
    assert not any("lora" in n for n, _ in model.named_parameters())
