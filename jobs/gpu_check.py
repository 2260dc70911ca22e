"""GPU check: validate the GPU path piece by piece on one machine, before a real run.

    python -m jobs.gpu_check [run_config=conf/gsm8k_qwen_1gpu.yaml] [device=auto] [layers=0]
                             [tokens=0] [attn=] [engine=auto]
                             [pieces=train_step,weight_push,engine,one_gpu] [out=runs/gpu_check.json]

Each piece runs in a process of its own (a crash, a CUDA error or memory left in the
caching allocator by one piece cannot decide the next) and is reported PASS / FAIL /
SKIP with its figures, then a JSON report. The trainer settings (attention kernel,
micro-batch tokens, dtypes, activation checkpointing, logits chunk) are the run
config's, so what passes here is what the run will do.

* train_step: our real `train_step` (FSDP2, bf16 compute over fp32 master weights,
  packed micro-batch, chunked logprobs, activation checkpointing) on a random-init
  model of `model_config`'s architecture (Qwen2.5-1.5B by default; `layers` shrinks
  it). On a GPU the peak allocated memory of the second step (optimizer included) must
  not exceed the memory model (areal_ray/train/memory.py), and the peak while loading
  and sharding is reported; on CPU the bytes autograd saves are compared with the
  model's bytes per token (exact for sdpa).
* weight_push: trainer-side `WeightGroup.send` to a receiver process, bit-identical
  (NCCL between two GPUs, gloo on CPU), then a receiver that joined but never
  receives: the sender must get an error within the timeout and stay alive (the
  condition for the object-store fallback). NCCL refuses two ranks on one GPU: SKIP
  with fewer than 2 GPUs.
* engine: the rollout engine installed (sglang, vllm, else hf): generate, abort a
  running request, load perturbed weights, and the engine's logprobs against the
  trainer's logprobs of the same tokens under the same weights.
* loop: the one-GPU loop without Ray, on one device in one process: the hf engine
  generates for `loop_prompts` x rollout.group_size samples, the trainer steps on them
  (random rewards: speed and memory are measured here, not learning), the new weights
  go into the engine, and the next round's tokens must carry the new version. Reports
  each phase's seconds and the device's peak memory.
* one_gpu: the run config's layout on this one GPU (areal_ray/cluster/plan.py): its
  memory plan must fit the device, then the plan is tried on the device. An engine's
  share is held by a stand-in allocation of the planned size (the engine of the step
  phase: released or not, per rollout.release_memory) while the real train step runs
  beside it; then, the trainer's state still alive, the engine's generating share is
  allocated too. PASS when both phases fit on the real device and the step's peak is
  within the plan.

Runs in the test suite on CPU (small model); run it on a GPU machine as it is.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_ray.config import opt
from jobs.cli import job_config

PIECES = ("train_step", "weight_push", "engine", "one_gpu", "loop")


@dataclass
class GPUCheckConfig:
    run_config: str = opt("conf/gsm8k_qwen_1gpu.yaml", "run config whose trainer settings (model.attn_implementation, model.dtype, train.*, algo.microbatch.max_tokens) and layout (one_gpu) are checked; empty: the defaults")
    device: str = opt("auto", "auto (cuda when available) | cuda | cpu")
    model_config: str = opt("conf/models/qwen2.5-1.5b.json", "HF config (file or dir) of the random-init model the train step runs")
    layers: int = opt(0, "decoder layers of that model (0: as configured)")
    tokens: int = opt(0, "tokens of the packed micro-batch of the train step; 0: the run config's algo.microbatch.max_tokens")
    attn: str = opt("", "attention kernel of the train step; empty: the run config's model.attn_implementation (sdpa if unset, and on CPU)")
    activation_checkpointing: str = opt("", "true|false: override the run config's train.activation_checkpointing")
    push_mb: int = opt(256, "size of the weights pushed in the weight_push piece")
    push_timeout_s: float = opt(10.0, "weight_push piece: the group's timeout, within which the sender must see that a receiver never receives (it stays 5 s longer)")
    engine: str = opt("auto", "auto (sglang, then vllm, then hf: the first installed) | sglang | vllm | hf")
    engine_model: str = opt("artifacts/tiny", "model directory the engine piece serves")
    loop_steps: int = opt(3, "loop piece: generate -> train -> push rounds")
    loop_prompts: int = opt(16, "loop piece: prompts per round (rollout.group_size samples each)")
    loop_new_tokens: int = opt(256, "loop piece: new tokens per sample")
    pieces: str = opt(",".join(PIECES), "comma-separated subset of " + ",".join(PIECES))
    piece_timeout_s: float = opt(900.0, "a piece still running after this is killed and FAILs")
    out: str = opt("runs/gpu_check.json", "JSON report")


def run_settings(c: GPUCheckConfig, dev: torch.device):
    """The run config the pieces follow, with gpu_check's overrides applied."""
    from areal_ray.config import load_config
    over = []
    if c.tokens:
        over.append(f"algo.microbatch.max_tokens={c.tokens}")
    if c.activation_checkpointing:
        over.append(f"train.activation_checkpointing={c.activation_checkpointing}")
    if dev.type != "cuda":  # flash kernels and bf16 compute are GPU matters
        over += ["model.attn_implementation=sdpa", "train.use_gpu=false", "weights.backend=gloo"]
    if c.attn:
        over.append(f"model.attn_implementation={c.attn}")
    cfg = load_config(c.run_config or None, over)
    if dev.type == "cuda":  # a flash kernel that cannot load fails here, saying why
        from areal_ray.cluster.attention import check_attention
        check_attention(cfg.model.attn_implementation, True)
    if not cfg.algo.microbatch.max_tokens:
        cfg.algo.microbatch.max_tokens = 4096
    return cfg


def step_settings(c: GPUCheckConfig, dev: torch.device):
    """`run_settings` for the pieces that step on `budget_seqs`: advantages are not
    normalised over the batch, since under a dense mask that batch is one sequence,
    which normalised against itself has advantage 0, no loss and no gradient."""
    cfg = run_settings(c, dev)
    cfg.algo.adv.norm = "none"
    return cfg


def cuda_device() -> torch.device:
    """The current GPU, with its index: torch's process groups refuse an index-less one."""
    return torch.device("cuda", torch.cuda.current_device())


def free_cuda() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------- train_step
def random_seqs(tokens: int, n: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n` prompt+output sequences of about tokens/n tokens, in groups of 2, with
    advantages +1 and -1: with none, a step has no loss and no gradient, and checks
    nothing of the backward pass's numbers."""
    g = torch.Generator().manual_seed(seed)
    each = max(4, tokens // n)
    seqs = []
    for i in range(n):
        ids = torch.randint(10, vocab, (each,), generator=g).tolist()
        p = each // 4
        seqs.append({"prompt_ids": ids[:p], "output_ids": ids[p:], "logprobs": [-1.0] * (each - p),
                     "versions": [0] * (each - p), "advantage": 1.0 if i % 2 == 0 else -1.0, "ticket": i // 2})
    return seqs


class SoloGroup:
    """A one-rank process group for FSDP2 (NCCL on a GPU, gloo on CPU), destroyed on
    exit only if it was made: a failed init must surface, not a failed cleanup."""

    def __init__(self, dev: torch.device):
        self.dev = dev

    def __enter__(self):
        import datetime

        import torch.distributed as dist
        cuda = self.dev.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120),
                                **({"device_id": self.dev} if cuda else {}))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def budget_seqs(cfg, m, vocab: int) -> tuple[list[dict], dict]:
    """Sequences that fill one micro-batch of `algo.microbatch.max_tokens`, and the
    micro-batches the trainer really makes of them. Under flash attention 8 sequences
    pack into one row; under a dense mask (sdpa) rows stop sooner (`dense_row_tokens`),
    so 8 sequences would run as several smaller micro-batches and the memory model would
    be checked at a size never run: one sequence of the whole budget is a micro-batch of it."""
    from areal_ray.train.batching import build_microbatches, dense_row_tokens, uses_varlen
    from areal_ray.train.fsdp import model_device
    varlen = uses_varlen(m.policy.config)
    budget = cfg.algo.microbatch.max_tokens
    seqs = random_seqs(budget, 8 if varlen else 1, vocab)
    row = dense_row_tokens(m.policy.config, model_device(m.policy))
    mbs = [mb for mb in build_microbatches(seqs, budget, cfg.algo.microbatch.pack, 0, varlen, row) if mb]
    return seqs, {"microbatches": len(mbs), "microbatch_tokens": max(mb["input_ids"].numel() for mb in mbs)}


def build_trainer(c: GPUCheckConfig, cfg, dev: torch.device):
    """(Models, HF config, DecoderShape): the run config's trainer on a random-init
    model of `c.model_config`, sharded with FSDP2 on `dev`."""
    from transformers import AutoConfig

    from areal_ray.train.fsdp import load_sharded_model
    from areal_ray.train.memory import DecoderShape, random_decoder
    from areal_ray.train.schedule import make_scheduler
    from areal_ray.train.step import Models
    hf = AutoConfig.from_pretrained(c.model_config)
    if c.layers:
        hf.num_hidden_layers = c.layers
    torch.manual_seed(0)
    attn = cfg.model.attn_implementation or "sdpa"
    model = load_sharded_model(
        "", cfg.model.dtype, device=dev, master_dtype=cfg.train.master_dtype,
        attn_implementation=attn, activation_checkpointing=cfg.train.activation_checkpointing,
        build=lambda _p, dtype, **kw: random_decoder(hf, dtype, "cpu", kw.get("attn_implementation", "sdpa")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    return Models(model, opt, make_scheduler(opt, 2, 0, "constant")), hf, DecoderShape.from_hf(hf)


def model_memory(cfg, shape, tokens: int):
    from areal_ray.train.memory import DTYPE_BYTES, trainer_memory
    return trainer_memory(shape, tokens, 1, compute_bytes=DTYPE_BYTES[cfg.model.dtype],
                          master_bytes=DTYPE_BYTES[cfg.train.master_dtype or cfg.model.dtype],
                          checkpointing=cfg.train.activation_checkpointing,
                          chunk_bytes=cfg.train.logits_chunk_mb << 20)


def timed_step(m, seqs, cfg, dev) -> tuple[dict, float, int]:
    """(stats, seconds, peak allocated bytes on a GPU) of one train step."""
    from areal_ray.train.step import train_step
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    stats = train_step(m, seqs, cfg, 0, 1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    return stats, time.perf_counter() - t0, peak


def check_train_step(c: GPUCheckConfig, dev: torch.device) -> dict:
    from areal_ray.train.fsdp import enable_activation_checkpointing
    from areal_ray.train.memory import DTYPE_BYTES, GIB, activation_bytes_per_token, random_decoder

    cfg = step_settings(c, dev)
    cuda = dev.type == "cuda"
    with SoloGroup(dev):
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        m, hf, shape = build_trainer(c, cfg, dev)
        load_peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
        seqs, batching = budget_seqs(cfg, m, hf.vocab_size)
        tokens = sum(len(s["prompt_ids"]) + len(s["output_ids"]) for s in seqs)
        out = {"attn_implementation": cfg.model.attn_implementation or "sdpa", "params": shape.params,
               "tokens": tokens, **batching, "activation_checkpointing": cfg.train.activation_checkpointing}
        timed_step(m, seqs, cfg, dev)  # AdamW's state now exists
        stats, step_s, peak = timed_step(m, seqs, cfg, dev)
        out.update(step_s=round(step_s, 3), tokens_per_s=round(tokens / step_s), loss=stats["loss"],
                   grad_norm=stats["grad_norm"])
        mem = model_memory(cfg, shape, batching["microbatch_tokens"])
        predicted = mem.total - mem.overhead  # the allocator does not see the context
        ok = bool(torch.isfinite(torch.tensor(stats["loss"]))) and 0 < stats["grad_norm"] < float("inf")
        if cuda:
            out.update(peak_gib=round(peak / GIB, 3), model_gib=round(predicted / GIB, 3),
                       peak_over_model=round(peak / predicted, 3), load_peak_gib=round(load_peak / GIB, 3),
                       model_parts_gib=mem.table())
            ok = ok and peak <= predicted
        else:
            from areal_ray.algo.packing import pack, packed_token_logprobs
            from areal_ray.train.memory import saved_activation_bytes
            # On a plain copy: FSDP's gathered weights would count as saved activations.
            b = DTYPE_BYTES[cfg.model.dtype]
            plain = random_decoder(hf, getattr(torch, cfg.model.dtype), dev, "sdpa")
            if cfg.train.activation_checkpointing:
                enable_activation_checkpointing(plain)
            plain.train()
            mb = pack(seqs, build_mask=True)
            # one row per logits chunk: the logits are recomputed, and modelled apart
            _, saved = saved_activation_bytes(
                lambda: packed_token_logprobs(plain, mb, 1.0, 4 * hf.vocab_size), plain)
            per_token = activation_bytes_per_token(shape, b, cfg.train.activation_checkpointing)
            out.update(saved_bytes_per_token=saved / tokens, model_bytes_per_token=per_token)
            ok = ok and abs(saved / tokens - per_token) <= 0.01 * per_token
        return {"status": "PASS" if ok else "FAIL", **out}


# ----------------------------------------------------------------- weight_push
def _push_member(rank: int, port: int, backend: str, device: int, mode: str, nbytes: int,
                 timeout_s: float, q) -> None:
    from areal_ray.weights.encoding import WeightGroup, digest, manifest_of
    try:
        if backend == "nccl":
            torch.cuda.set_device(device)
        store = WeightGroup.connect("127.0.0.1", port, 60, is_master=rank == 0)
        group = WeightGroup(store, 1, rank, 2, timeout_s=timeout_s, backend=backend)
        g = torch.Generator().manual_seed(1)
        n = nbytes // 2 // 8
        state = {f"w{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(8)}
        specs = manifest_of(state.items())
        if rank == 0:
            t0 = time.perf_counter()
            try:
                sent = group.send(iter(state.values()), specs, 64 << 20)
                q.put((0, "sent", {"bytes": sent["bytes"], "s": time.perf_counter() - t0}))
            except RuntimeError as e:
                q.put((0, "error", {"message": str(e), "s": time.perf_counter() - t0}))
        elif mode == "idle":
            time.sleep(timeout_s + 5)
            q.put((1, "idle", {}))
        else:
            got = {k: t.cpu().clone() for k, t in group.recv(specs, 64 << 20)}
            q.put((1, "got", {"equal": digest(got) == digest(state)}))
    except BaseException as e:  # noqa: BLE001 - reported, never hangs the check
        q.put((rank, "crash", {"message": f"{type(e).__name__}: {e}"}))


def _push_round(backend: str, devices: list[int], mode: str, nbytes: int, timeout_s: float) -> dict:
    from areal_ray.weights.encoding import free_port
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_push_member,
                         args=(r, port, backend, devices[r], mode, nbytes, timeout_s, q))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    res = {}
    while not q.empty():
        rank, kind, info = q.get()
        res[rank] = {"kind": kind, **info}
    res["hung"] = [i for i, p in enumerate(procs) if p.exitcode is None]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    return res


def check_weight_push(c: GPUCheckConfig, dev: torch.device) -> dict:
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return {"status": "SKIP", "reason": f"{torch.cuda.device_count()} GPU: NCCL refuses two ranks "
                "on one GPU; a one-GPU layout pushes by shm (weights.path=shm)"}
    devices = [0, 1] if backend == "nccl" else [0, 0]
    ok_round = _push_round(backend, devices, "receive", c.push_mb << 20, c.push_timeout_s)
    fail_round = _push_round(backend, devices, "idle", 1 << 20, c.push_timeout_s)
    sent, got, err = ok_round.get(0, {}), ok_round.get(1, {}), fail_round.get(0, {})
    out = {"backend": backend, "push": ok_round, "absent_receiver": fail_round}
    if sent.get("kind") == "sent":
        out["gbit_per_s"] = round(sent["bytes"] * 8 / sent["s"] / 1e9, 2)
    ok = (sent.get("kind") == "sent" and got.get("equal") is True and not ok_round["hung"]
          and err.get("kind") == "error" and err["s"] < 3 * c.push_timeout_s
          and 0 not in fail_round["hung"])
    return {"status": "PASS" if ok else "FAIL", **out}


# ----------------------------------------------------------------- engine
def pick_engine(name: str) -> str:
    import importlib.util
    if name != "auto":
        return name
    return next((b for b in ("sglang", "vllm") if importlib.util.find_spec(b)), "hf")


async def _engine_round(engine, model, tok_ids: list[int], context: int, release: bool,
                        check) -> dict:
    """Generate, abort a long request, (release and resume the engine's memory, as a
    replica sharing the trainer's GPU does each step), push new weights, and judge the
    load probe by the run's rule (`check`, weights/probe.py) from version 0, where
    engine and model hold the same weights: the measured engine/trainer gap is reported."""
    from areal_ray.algo.logprobs import token_logprobs
    from areal_ray.rollout.engines.base import GenerationRequest
    from areal_ray.train.probe import model_probe
    from areal_ray.weights.probe import ProbeMismatch, max_abs_diff, probe_ids
    ids = probe_ids(engine.limits.vocab_size)
    trainer0 = model_probe(model)
    engine0 = await engine.score(ids)
    check.baseline(*trainer0)
    check.register("engine", (ids, engine0))
    gap0 = max_abs_diff(engine0, trainer0[1])
    first = await engine.generate(GenerationRequest(tok_ids, 16, temperature=1.0, ignore_eos=True))
    # The longest request the model's context allows (sglang refuses more than that).
    budget = context - len(tok_ids) - 1
    long = asyncio.ensure_future(engine.generate(GenerationRequest(tok_ids, budget, ignore_eos=True)))
    for _ in range(500):  # abort it once it runs, before a fast engine finishes it
        if engine.load().get("running", 0) or long.done():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)
    await engine.pause("abort")
    aborted = await long
    await engine.resume()
    if release:  # sglang's memory saver, vLLM's sleep mode: what the one-GPU configs use
        await engine.release_memory()
        await engine.resume_memory()
    g = torch.Generator().manual_seed(2)
    # drawn on the CPU (one stream of numbers on every device), added where the model is
    state = {k: v + 0.01 * torch.randn(v.shape, generator=g).to(v.device, v.dtype)
             for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    check.expect(1, *model_probe(model))
    await engine.update_weights(state, 1, "abort")
    try:
        judged = check.check("engine", 1, (ids, await engine.score(ids)))
        probe = {"probe_rule": check.rule.name, "probe_max_diff": round(judged.max_diff, 5),
                 "probe_moved": judged.moved and round(judged.moved, 3),
                 "probe_unseen": judged.unseen}
    except ProbeMismatch as e:
        probe = {"probe_rule": check.rule.name, "probe_error": str(e)}
    res = await engine.generate(GenerationRequest(tok_ids, 24, temperature=1.0, ignore_eos=True))
    ids = torch.tensor([tok_ids + res.output_ids], device=model.device)
    with torch.no_grad():
        ref = token_logprobs(model, ids, torch.ones_like(ids))[0, len(tok_ids) - 1:]
    diff = (ref.float().cpu() - torch.tensor(res.logprobs)).abs().max().item()
    return {"generated": len(first.output_ids), "aborted": aborted.stop_reason,
            "aborted_tokens": len(aborted.output_ids), "versions_after_update": sorted(set(res.versions)),
            "released": release, "logprob_max_abs_diff": round(diff, 5),
            "probe_gap_v0": round(gap0, 5), **probe}


def check_engine(c: GPUCheckConfig, dev: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    from areal_ray.rollout.engines.base import EngineOptions
    from areal_ray.rollout.engines.registry import build_engine
    from areal_ray.weights.probe import ProbeCheck, ProbeRule, probe_atol
    backend = pick_engine(c.engine)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    # The run config's memory release: sglang's memory saver or vLLM's sleep mode is
    # chosen when the engine is built, and fails there if it cannot start (R3-C2).
    release = run_settings(c, dev).rollout.release_memory
    engine = build_engine(backend, c.engine_model, EngineOptions(dtype=dtype, device=str(dev),
                                                                 release_memory=release))
    # The rule a run in this dtype takes (weights/probe.py): exact in float32, moved in bf16.
    rule = ProbeRule() if dtype == "bfloat16" else ProbeRule(atol=probe_atol(backend))
    try:
        model = AutoModelForCausalLM.from_pretrained(c.engine_model, dtype=getattr(torch, dtype)).to(dev)
        out = asyncio.run(_engine_round(engine, model, [5, 6, 7, 8, 9, 10],
                                        model.config.max_position_embeddings, release,
                                        ProbeCheck(rule)))
    finally:
        engine.shutdown()
        del engine
    # Sampled logprobs against the model's own: judged in float32 only (bf16 kernels
    # differ by more than any fixed bound: weights/probe.py); the probe judges both.
    tol = 1e-3 if dtype == "float32" else None
    ok = (out["generated"] == 16 and out["aborted"] == "abort" and out["versions_after_update"] == [1]
          and "probe_error" not in out and (tol is None or out["logprob_max_abs_diff"] <= tol))
    return {"status": "PASS" if ok else "FAIL", "backend": backend, "tolerance": tol, **out}


def check_one_gpu(c: GPUCheckConfig, dev: torch.device) -> dict:
    from areal_ray.cluster.plan import GIB, REPLICA, TRAINER, Node, demands, engine_gib, memory_plan, place, trainer_gib
    if dev.type != "cuda":
        return {"status": "SKIP", "reason": "needs a GPU"}
    cfg = step_settings(c, dev)
    total_gib = torch.cuda.get_device_properties(dev).total_memory / GIB
    p = place(demands(cfg), [Node("this", 64, 1, total_gib)])
    shared = [g for g in p.sharing().values() if {REPLICA, TRAINER} <= {s.role for s in g}]
    if not p.fits or not shared:
        return {"status": "FAIL", "reason": f"{c.run_config} does not put a replica and a trainer "
                "worker on one GPU", "unplaced": [d.role for d, _ in p.unplaced]}
    with SoloGroup(dev):
        m, hf, shape = build_trainer(c, cfg, dev)
        plan = memory_plan(cfg, shape, p, total_gib)
        out = {"gpu_gib": round(total_gib, 2), "plan": plan["gpus"][0]["gib"], "plan_fits": plan["fits"],
               "engine_gib": engine_gib(cfg, shape, total_gib), "trainer_gib": trainer_gib(cfg, shape),
               "release_memory": cfg.rollout.release_memory}
        if not plan["fits"]:
            return {"status": "FAIL", "reason": "the memory plan does not fit this GPU", **out}
        seqs, batching = budget_seqs(cfg, m, hf.vocab_size)
        out.update(batching)
        phase = "asleep" if cfg.rollout.release_memory else "awake"
        # The engine's share in the step phase, held while the real step runs beside it.
        engine = torch.empty(int(out["engine_gib"][phase] * GIB), dtype=torch.uint8, device=dev)
        try:
            timed_step(m, seqs, cfg, dev)
            _, step_s, peak = timed_step(m, seqs, cfg, dev)
            out.update(step_ok=True, step_s=round(step_s, 3), step_peak_gib=round(peak / GIB, 3))
        except torch.OutOfMemoryError as e:
            out.update(step_ok=False, step_error=str(e).split("\n")[0])
        del engine
        free_cuda()
        # Generation: the trainer's state stays; the engine takes its whole share again.
        resident = torch.cuda.memory_allocated(dev)
        try:
            engine = torch.empty(int(out["engine_gib"]["awake"] * GIB), dtype=torch.uint8, device=dev)
            out["generate_ok"] = True
            del engine
        except torch.OutOfMemoryError as e:
            out.update(generate_ok=False, generate_error=str(e).split("\n")[0])
        free, _ = torch.cuda.mem_get_info(dev)
        out.update(trainer_resident_gib=round(resident / GIB, 3), device_free_gib_after=round(free / GIB, 2))
    ok = out.get("step_ok") and out.get("generate_ok") and \
        out["step_peak_gib"] <= out["trainer_gib"]["step"]
    return {"status": "PASS" if ok else "FAIL", **out}


def engine_dir(c: GPUCheckConfig, hf, dtype: str, out: Path) -> str:
    """A model dir of `hf`'s architecture (random weights; the trainer's are loaded
    before the first round) with the tokenizer files of `c.engine_model`."""
    import shutil

    from areal_ray.train.memory import random_decoder
    random_decoder(hf, getattr(torch, dtype), "cpu").save_pretrained(out)
    for f in Path(c.engine_model).glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    return str(out)


async def _loop_rounds(c: GPUCheckConfig, cfg, m, engine, dev, vocab: int) -> list[dict]:
    from areal_ray.rollout.engines.base import GenerationRequest
    from areal_ray.train.fsdp import full_state_dict
    from areal_ray.train.step import train_step
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, vocab, (64,), generator=g).tolist() for _ in range(c.loop_prompts)]
    dtype = getattr(torch, cfg.model.dtype)
    rounds = []
    for v in range(1, c.loop_steps + 1):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        res = await asyncio.gather(*[engine.generate(GenerationRequest(p, c.loop_new_tokens, 1.0))
                                     for p in prompts for _ in range(cfg.rollout.group_size)])
        t1 = time.perf_counter()
        new_tokens = sum(len(r.output_ids) for r in res)
        print(f"[gpu_check] loop round {v}: generated {new_tokens} tokens "
              f"in {t1 - t0:.1f} s", flush=True)
        seqs = [{"prompt_ids": prompts[i // cfg.rollout.group_size], "output_ids": r.output_ids,
                 "logprobs": r.logprobs, "versions": r.versions, "advantage": float(i % 2) * 2 - 1,
                 "ticket": i // cfg.rollout.group_size} for i, r in enumerate(res) if r.output_ids]
        free_cuda()  # what a released engine gives back before the step
        stats = train_step(m, seqs, cfg, engine.pad_id or 0, v)
        t2 = time.perf_counter()
        state = {k: t.to(dtype) for k, t in full_state_dict(m.policy).items()}
        await engine.update_weights(state, v, "abort")
        t3 = time.perf_counter()
        print(f"[gpu_check] loop round {v}: step {t2 - t1:.1f} s ({stats['n_microbatches']} micro-batches), "
              f"push {t3 - t2:.1f} s", flush=True)
        rounds.append({"version": v, "served_versions": sorted({x for r in res for x in r.versions}),
                       "samples": len(seqs), "new_tokens": new_tokens,
                       "generate_s": round(t1 - t0, 2), "train_s": round(t2 - t1, 2),
                       "push_s": round(t3 - t2, 2), "microbatches": stats["n_microbatches"],
                       "loss": stats["loss"],
                       "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
                       if dev.type == "cuda" else None})
    return rounds


def check_loop(c: GPUCheckConfig, dev: torch.device) -> dict:
    import tempfile

    from areal_ray.rollout.engines.hf import HFEngine
    from areal_ray.train.fsdp import full_state_dict
    cfg = run_settings(c, dev)
    with SoloGroup(dev), tempfile.TemporaryDirectory() as tmp:
        m, hf, shape = build_trainer(c, cfg, dev)
        path = engine_dir(c, hf, cfg.model.dtype, Path(tmp))
        engine = HFEngine(path, max_batch_size=c.loop_prompts * cfg.rollout.group_size,
                          device=str(dev), dtype=cfg.model.dtype)
        try:
            engine.load_state_dict({k: t.to(getattr(torch, cfg.model.dtype))
                                    for k, t in full_state_dict(m.policy).items()})
            rounds = asyncio.run(_loop_rounds(c, cfg, m, engine, dev, hf.vocab_size))
        finally:
            engine.shutdown()
    # round v generates with version v-1's weights: each push must have reached the engine
    ok = all(r["served_versions"] == [r["version"] - 1] and r["samples"] for r in rounds) and \
        all(bool(torch.isfinite(torch.tensor(r["loss"]))) for r in rounds)
    last = rounds[-1]
    return {"status": "PASS" if ok else "FAIL", "params": shape.params,
            "samples_per_round": last["samples"],
            "gen_tokens_per_s": round(last["new_tokens"] / last["generate_s"]),
            "rounds": rounds}


CHECKS = {"loop": check_loop, "train_step": check_train_step, "weight_push": check_weight_push, "engine": check_engine,
          "one_gpu": check_one_gpu}


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return cuda_device()
    return torch.device("cpu")


def _piece(name: str, c: GPUCheckConfig, q) -> None:
    """One piece in this (spawned) process; its result, or its error, goes to `q`.
    A piece still running shortly before its timeout prints every thread's stack: a
    hang then says where it is, not only that it happened."""
    import faulthandler
    faulthandler.dump_traceback_later(max(1.0, c.piece_timeout_s - 15), exit=False)
    try:
        res = CHECKS[name](c, pick_device(c.device))
    except Exception as e:  # noqa: BLE001 - reported as the piece's FAIL
        res = {"status": "FAIL", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-3000:]}
    q.put(res)


def run_piece(name: str, c: GPUCheckConfig) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_piece, args=(name, c, q))  # not a daemon: pieces start processes
    proc.start()
    try:
        res = q.get(timeout=c.piece_timeout_s)
    except queue.Empty:
        res = {"status": "FAIL", "error": f"no result after {c.piece_timeout_s:g} s "
               f"(exit code {proc.exitcode}: a crash, or a hang)"}
    proc.join(30)
    if proc.exitcode is None:
        proc.kill()
    return res


def run(c: GPUCheckConfig) -> dict:
    dev = pick_device(c.device)
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "run_config": c.run_config, "pieces": {}}
    for name in [p.strip() for p in c.pieces.split(",") if p.strip()]:
        t0 = time.perf_counter()
        res = run_piece(name, c)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report["pieces"][name] = res
        print(f"[gpu_check] {name:12s} {res['status']}  "
              + json.dumps({k: v for k, v in res.items() if k not in ("status", "push", "absent_receiver",
                                                                       "traceback")}), flush=True)
        if "traceback" in res:
            print(res["traceback"], flush=True)
    Path(c.out).parent.mkdir(parents=True, exist_ok=True)
    Path(c.out).write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m jobs.gpu_check", __doc__.split("\n\n")[0], GPUCheckConfig)
    if c is None:
        return 2
    unknown = {p.strip() for p in c.pieces.split(",") if p.strip()} - set(PIECES)
    if unknown or c.device not in ("auto", "cuda", "cpu"):
        print(f"error: pieces must be among {PIECES} and device auto|cuda|cpu", file=sys.stderr)
        return 2
    report = run(c)
    statuses = [p["status"] for p in report["pieces"].values()]
    print(f"[gpu_check] {report['device']}: " + ", ".join(
        f"{k} {v['status']}" for k, v in report["pieces"].items()) + f"  -> {c.out}")
    return 1 if "FAIL" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
