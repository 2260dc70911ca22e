"""The sharded trainer models on a real (one-rank, gloo) process group, on the CPU:
the FSDP2 path of fsdp.py, train_step and the checkpoint's optimizer round trip, as
Ray Train runs them. The GPU path is the same code with another device."""


import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from areal_ray.config import load_config
from areal_ray.train.batching import all_reduce, comm_device
from areal_ray.train.fsdp import full_state_dict, load_sharded_model, model_device
from areal_ray.train.schedule import make_scheduler
from areal_ray.train.step import Models, train_step
from tests.algo.test_packing import make_seqs


def test_sharded_model_lives_on_the_device_and_hands_out_cpu_weights(random_model_dir, one_rank_group):
    plain = AutoModelForCausalLM.from_pretrained(random_model_dir)
    model = load_sharded_model(random_model_dir, device=torch.device("cpu"))
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) and p.device_mesh.device_type == "cpu" for p in params)
    assert model_device(model) == torch.device("cpu")
    weights = full_state_dict(model)
    assert set(weights) == set(plain.state_dict())
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in weights.values())
    assert all(torch.equal(weights[k], v) for k, v in plain.state_dict().items())
    assert comm_device() == torch.device("cpu") and all_reduce([1.5, 2.0]) == [1.5, 2.0]


def test_master_dtype_keeps_fp32_weights_and_computes_in_bf16(random_model_dir, one_rank_group):
    model = load_sharded_model(random_model_dir, "bfloat16", master_dtype="float32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert {v.dtype for v in full_state_dict(model).values()} == {torch.float32}


def test_train_step_on_a_sharded_mixed_precision_model(random_model_dir, one_rank_group):
    model = load_sharded_model(random_model_dir, "bfloat16", master_dtype="float32")
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    cfg = load_config(None, ["algo.microbatch.max_tokens=64"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seqs = [dict(s, ticket=t) for t in range(2) for s in make_seqs(3, seed=t)]
    stats = train_step(Models(model, opt, make_scheduler(opt, 10, 0, "constant")), seqs, cfg, 0, 0)
    assert stats["n_microbatches"] > 1 and stats["grad_norm"] > 0
    after = full_state_dict(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_sharded_checkpoint_round_trips_model_and_optimizer(random_model_dir, one_rank_group, tmp_path):
    from types import SimpleNamespace

    from areal_ray.train.checkpoint import load_sharded, save_sharded

    def build():
        model = load_sharded_model(random_model_dir)
        return SimpleNamespace(policy=model, opt=torch.optim.AdamW(model.parameters(), lr=1e-2),
                               critic=None, critic_opt=None)

    a = build()
    a.policy(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    a.opt.step()
    save_sharded(a, tmp_path / "state")
    assert {p.name for p in (tmp_path / "state").iterdir()} == {".metadata", "__0_0.distcp"}
    b = build()
    load_sharded(b, tmp_path / "state")
    assert all(torch.equal(x, y) for x, y in zip(full_state_dict(a.policy).values(),
                                                 full_state_dict(b.policy).values()))
    for (_, sa), (_, sb) in zip(a.opt.state.items(), b.opt.state.items()):
        assert isinstance(sb["exp_avg"], DTensor)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[key].full_tensor() if hasattr(sa[key], "full_tensor") else sa[key]),
                               torch.as_tensor(sb[key].full_tensor() if hasattr(sb[key], "full_tensor") else sb[key])), key


def test_activation_checkpointing_keeps_gradients_and_saves_less(random_model_dir, one_rank_group):
    from areal_ray.algo.packing import pack, packed_token_logprobs
    from tests.algo.test_logprobs import saved_bytes
    mb = pack(make_seqs(4, seed=3), build_mask=True)
    grads, kept = [], []
    for ac in (False, True):
        model = load_sharded_model(random_model_dir, activation_checkpointing=ac)
        lp, _, total = saved_bytes(lambda model=model: packed_token_logprobs(model, mb))
        (lp * mb["loss_mask"]).sum().backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        kept.append(total)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6)
    assert kept[1] < kept[0] / 2, kept
