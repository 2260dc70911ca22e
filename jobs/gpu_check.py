"""GPU check: validate the GPU path piece by piece on one machine, before a real run.

    python -m jobs.gpu_check [device=auto] [layers=0] [tokens=4096] [engine=auto]
                             [pieces=train_step,weight_push,engine] [out=runs/gpu_check.json]

Pieces, each reported PASS / FAIL / SKIP with its figures, then a JSON report:

* train_step: our real `train_step` (FSDP2, bf16 compute over fp32 master weights,
  packed micro-batch, chunked logprobs, activation checkpointing) on a random-init
  model of `model_config`'s architecture (Qwen2.5-1.5B by default; `layers` shrinks
  it). On a GPU the peak allocated memory of the second step is compared with the
  memory model (areal_ray/train/memory.py) and must not exceed it; on CPU the bytes
  autograd saves are compared with the model's bytes per token (exact for sdpa).
* weight_push: trainer-side `WeightGroup.send` to a receiver process, bit-identical
  (NCCL between two GPUs, gloo on CPU), then a receiver that joined but never
  receives: the sender must get an error within the timeout and stay alive (the
  condition for the object-store fallback). NCCL refuses two ranks on one GPU: SKIP.
* engine: the rollout engine installed (sglang, vllm, else hf): generate, abort a
  running request, load perturbed weights, and the engine's logprobs against the
  trainer's logprobs of the same tokens under the same weights.

Runs in the test suite on CPU (small model); run it on a GPU machine as it is.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_ray.config import opt
from jobs.cli import job_config

PIECES = ("train_step", "weight_push", "engine")


@dataclass
class GPUCheckConfig:
    device: str = opt("auto", "auto (cuda when available) | cuda | cpu")
    model_config: str = opt("conf/models/qwen2.5-1.5b.json", "HF config (file or dir) of the random-init model the train step runs")
    layers: int = opt(0, "decoder layers of that model (0: as configured)")
    tokens: int = opt(4096, "tokens of the packed micro-batch of the train step")
    activation_checkpointing: bool = opt(True, "recompute layers in the backward (train.activation_checkpointing)")
    push_mb: int = opt(256, "size of the weights pushed in the weight_push piece")
    engine: str = opt("auto", "auto (sglang, then vllm, then hf: the first installed) | sglang | vllm | hf")
    engine_model: str = opt("artifacts/tiny", "model directory the engine piece serves")
    pieces: str = opt(",".join(PIECES), "comma-separated subset of " + ",".join(PIECES))
    out: str = opt("runs/gpu_check.json", "JSON report")


# ----------------------------------------------------------------- train_step
def random_seqs(tokens: int, n: int, vocab: int, seed: int = 0) -> list[dict]:
    """`n` prompt+output sequences of about tokens/n tokens, in groups of 2."""
    g = torch.Generator().manual_seed(seed)
    each = max(4, tokens // n)
    seqs = []
    for i in range(n):
        ids = torch.randint(10, vocab, (each,), generator=g).tolist()
        p = each // 4
        seqs.append({"prompt_ids": ids[:p], "output_ids": ids[p:], "logprobs": [-1.0] * (each - p),
                     "versions": [0] * (each - p), "advantage": float(i % 2), "ticket": i // 2})
    return seqs


def check_train_step(c: GPUCheckConfig, dev: torch.device) -> dict:
    import datetime
    import importlib.util

    import torch.distributed as dist
    from transformers import AutoConfig

    from areal_ray.config import load_config
    from areal_ray.train.fsdp import enable_activation_checkpointing, load_sharded_model
    from areal_ray.train.memory import DecoderShape, activation_bytes_per_token, random_decoder, trainer_memory
    from areal_ray.train.schedule import make_scheduler
    from areal_ray.train.step import Models, train_step

    hf = AutoConfig.from_pretrained(c.model_config)
    if c.layers:
        hf.num_hidden_layers = c.layers
    cuda = dev.type == "cuda"
    attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120),
                            **({"device_id": dev} if cuda else {}))
    try:
        torch.manual_seed(0)
        model = load_sharded_model(
            "", "bfloat16", device=dev, master_dtype="float32", attn_implementation=attn,
            activation_checkpointing=c.activation_checkpointing,
            build=lambda _p, dtype, **kw: random_decoder(hf, dtype, dev, kw.get("attn_implementation", "sdpa")))
        cfg = load_config(None, [f"algo.microbatch.max_tokens={c.tokens}", "algo.batch_groups=4",
                                 f"train.activation_checkpointing={c.activation_checkpointing}"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        m = Models(model, opt, make_scheduler(opt, 2, 0, "constant"))
        seqs = random_seqs(c.tokens, 8, hf.vocab_size)
        shape = DecoderShape.from_hf(hf)
        out = {"attn_implementation": attn, "params": shape.params, "tokens": sum(
            len(s["prompt_ids"]) + len(s["output_ids"]) for s in seqs)}
        train_step(m, seqs, cfg, 0, 1)  # AdamW's state now exists
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        stats = train_step(m, seqs, cfg, 0, 1)
        out.update(step_s=round(time.perf_counter() - t0, 3), loss=stats["loss"],
                   grad_norm=stats["grad_norm"])
        model_mem = trainer_memory(shape, out["tokens"], 1, checkpointing=c.activation_checkpointing,
                                   chunk_bytes=cfg.train.logits_chunk_mb << 20)
        predicted = model_mem.total - model_mem.overhead  # the allocator does not see the context
        ok = bool(torch.isfinite(torch.tensor(stats["loss"])))
        if cuda:
            peak = torch.cuda.max_memory_allocated(dev)
            out.update(peak_gib=round(peak / 2**30, 3), model_gib=round(predicted / 2**30, 3),
                       peak_over_model=round(peak / predicted, 3))
            ok = ok and peak <= predicted
        else:
            from areal_ray.algo.packing import pack, packed_token_logprobs
            from areal_ray.train.memory import saved_activation_bytes
            # On a plain copy: FSDP's gathered weights would count as saved activations.
            plain = random_decoder(hf, torch.bfloat16, dev, attn)
            if c.activation_checkpointing:
                enable_activation_checkpointing(plain)
            plain.train()
            mb = pack(seqs, build_mask=True)
            # one row per logits chunk: the logits are recomputed, and modelled apart
            _, saved = saved_activation_bytes(
                lambda: packed_token_logprobs(plain, mb, 1.0, 4 * hf.vocab_size), plain)
            per_token = activation_bytes_per_token(shape, 2, c.activation_checkpointing)
            out.update(saved_bytes_per_token=saved / out["tokens"], model_bytes_per_token=per_token)
            ok = ok and abs(saved / out["tokens"] - per_token) <= 0.01 * per_token
        return {"status": "PASS" if ok else "FAIL", **out}
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------- weight_push
def _push_member(rank: int, port: int, backend: str, device: int, mode: str, nbytes: int, q) -> None:
    from areal_ray.weights import WeightGroup, digest, manifest_of
    try:
        if backend == "nccl":
            torch.cuda.set_device(device)
        store = WeightGroup.connect("127.0.0.1", port, 60, is_master=rank == 0)
        group = WeightGroup(store, 1, rank, 2, timeout_s=10, backend=backend)
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
                q.put((0, "error", {"message": str(e)[:200], "s": time.perf_counter() - t0}))
        elif mode == "idle":
            time.sleep(15)
            q.put((1, "idle", {}))
        else:
            got = {k: t.cpu().clone() for k, t in group.recv(specs, 64 << 20)}
            q.put((1, "got", {"equal": digest(got) == digest(state)}))
    except BaseException as e:  # noqa: BLE001 - reported, never hangs the check
        q.put((rank, "crash", {"message": f"{type(e).__name__}: {e}"[:300]}))


def _push_round(backend: str, devices: list[int], mode: str, nbytes: int) -> dict:
    from areal_ray.weights import free_port
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_push_member, args=(r, port, backend, devices[r], mode, nbytes, q))
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
    devices = [0, min(1, torch.cuda.device_count() - 1)] if backend == "nccl" else [0, 0]
    ok_round = _push_round(backend, devices, "receive", c.push_mb << 20)
    crash = " ".join(v.get("message", "") for k, v in ok_round.items() if k != "hung")
    if backend == "nccl" and "Duplicate GPU" in crash:
        return {"status": "SKIP", "reason": "NCCL refuses two ranks on one GPU; needs 2 GPUs"}
    fail_round = _push_round(backend, devices, "idle", 1 << 20)
    sent, got, err = ok_round.get(0, {}), ok_round.get(1, {}), fail_round.get(0, {})
    out = {"backend": backend, "push": ok_round, "absent_receiver": fail_round}
    if sent.get("kind") == "sent":
        out["gbit_per_s"] = round(sent["bytes"] * 8 / sent["s"] / 1e9, 2)
    ok = (sent.get("kind") == "sent" and got.get("equal") is True and not ok_round["hung"]
          and err.get("kind") == "error" and err["s"] < 30 and 0 not in fail_round["hung"])
    return {"status": "PASS" if ok else "FAIL", **out}


# ----------------------------------------------------------------- engine
def pick_engine(name: str) -> str:
    import importlib.util
    if name != "auto":
        return name
    return next((b for b in ("sglang", "vllm") if importlib.util.find_spec(b)), "hf")


async def _engine_round(engine, model, tok_ids: list[int]) -> dict:
    from areal_ray.algo.logprobs import token_logprobs
    from areal_ray.rollout.engine import GenerationRequest
    first = await engine.generate(GenerationRequest(tok_ids, 16, temperature=1.0, ignore_eos=True))
    long = asyncio.ensure_future(engine.generate(GenerationRequest(tok_ids, 100_000, ignore_eos=True)))
    await asyncio.sleep(0.5)
    await engine.pause("abort")
    aborted = await long
    await engine.resume()
    g = torch.Generator().manual_seed(2)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=g).to(v.dtype)
             for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    await engine.update_weights(state, 1, "abort")
    res = await engine.generate(GenerationRequest(tok_ids, 24, temperature=1.0, ignore_eos=True))
    ids = torch.tensor([tok_ids + res.output_ids])
    with torch.no_grad():
        ref = token_logprobs(model, ids, torch.ones_like(ids))[0, len(tok_ids) - 1:]
    diff = (ref - torch.tensor(res.logprobs)).abs().max().item()
    return {"generated": len(first.output_ids), "aborted": aborted.stop_reason,
            "aborted_tokens": len(aborted.output_ids), "versions_after_update": sorted(set(res.versions)),
            "logprob_max_abs_diff": round(diff, 5)}


def check_engine(c: GPUCheckConfig, dev: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    from areal_ray.rollout.backends import build_engine
    backend = pick_engine(c.engine)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    engine = build_engine(backend, c.engine_model, dtype=dtype,
                          **({"device": str(dev)} if backend == "hf" else {}))
    try:
        model = AutoModelForCausalLM.from_pretrained(c.engine_model, dtype=getattr(torch, dtype)).to(dev)
        out = asyncio.run(_engine_round(engine, model, [5, 6, 7, 8, 9, 10]))
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
        del engine
    tol = 0.05 if dtype == "bfloat16" else 1e-3
    ok = (out["generated"] == 16 and out["aborted"] == "abort" and out["versions_after_update"] == [1]
          and out["logprob_max_abs_diff"] <= tol)
    return {"status": "PASS" if ok else "FAIL", "backend": backend, "tolerance": tol, **out}


CHECKS = {"train_step": check_train_step, "weight_push": check_weight_push, "engine": check_engine}


def run(c: GPUCheckConfig) -> dict:
    dev = torch.device("cuda" if c.device == "cuda" or (c.device == "auto" and torch.cuda.is_available())
                       else "cpu")
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "pieces": {}}
    for name in [p.strip() for p in c.pieces.split(",") if p.strip()]:
        t0 = time.perf_counter()
        try:
            res = CHECKS[name](c, dev)
        except Exception as e:  # noqa: BLE001 - a failing piece must not hide the others
            res = {"status": "FAIL", "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-2000:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report["pieces"][name] = res
        print(f"[gpu_check] {name:12s} {res['status']}  "
              + json.dumps({k: v for k, v in res.items() if k not in ("status", "push", "absent_receiver",
                                                                       "traceback")}), flush=True)
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
