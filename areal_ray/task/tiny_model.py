"""Build the embedded tiny model: a Qwen2-architecture causal LM with a short SFT warm start.

The warm start has two phases. Phase 1 teaches worked arithmetic (about 95% greedy
accuracy). Phase 2, a few steps on data dominated by bare answers (see
areal_ray/task/arith.py), gives the model the habit of answering without showing
work. It stops as soon as greedy accuracy on a dev split falls to
`habit_target_accuracy`, so RL starts from a modest, non-zero accuracy with a real
behaviour to learn: that working the problem out pays. (A fixed step count landed
anywhere between 3% and 20% depending on the data stream.) The result is saved with `save_pretrained` and is an ordinary HF
model directory, loadable by transformers' Auto classes (and by SGLang on a GPU).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase, Qwen2Config

from areal_ray.task.arith import ArithProblem, make_split
from areal_ray.task.tokenizer import save_char_tokenizer


@dataclass
class TinyModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    max_position_embeddings: int = 256
    seed: int = 0
    sft_steps: int = 1200         # phase 1: worked solutions only, cosine from sft_lr
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    max_steps_per_problem: int = 8
    habit_max_steps: int = 60     # phase 2: a mix dominated by bare answers, constant habit_lr,
    habit_lr: float = 3e-4        # until greedy dev accuracy falls to habit_target_accuracy
    habit_p_direct: float = 0.8
    habit_target_accuracy: float = 0.25
    habit_check_every: int = 3
    dev_size: int = 128


def qwen2_config(spec: TinyModelSpec, tok: PreTrainedTokenizerBase) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tok), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)


def encode_sft(tok, problems: list[ArithProblem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels); labels cover the solution + EOS only."""
    rows, masks = [], []
    for p in problems:
        prompt = tok(p.prompt, add_special_tokens=False)["input_ids"]
        sol = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt + sol)
        masks.append([0] * len(prompt) + [1] * len(sol))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
        labels[i, : len(r)] = torch.where(torch.tensor(m).bool(), torch.tensor(r), -100)
    return ids, att, labels


@torch.no_grad()
def greedy_accuracy(model, tok, problems: list[ArithProblem], max_new_tokens: int = 96) -> float:
    from areal_ray.reward.math import math_reward

    model.eval()
    enc = tok([p.prompt for p in problems], add_special_tokens=False, padding=True,
              return_tensors="pt")
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train()
    return sum(math_reward(t, p.answer) for t, p in zip(texts, problems)) / len(problems)


def _sft_step(model, opt, tok, batch, lr: float) -> float:
    for g in opt.param_groups:
        g["lr"] = lr
    ids, att, labels = encode_sft(tok, batch)
    loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def sft(model, tok, spec: TinyModelSpec, log=print) -> dict:
    rng = random.Random(spec.seed + 1)
    dev = make_split(spec.seed + 7_000_000, spec.dev_size, spec.max_steps_per_problem)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for step in range(spec.sft_steps):
        lr = spec.sft_lr * 0.5 * (1 + math.cos(math.pi * step / spec.sft_steps))
        batch = make_split(rng.randrange(1 << 30), spec.sft_batch_size, spec.max_steps_per_problem)
        loss = _sft_step(model, opt, tok, batch, lr)
        if step % 100 == 0 or step == spec.sft_steps - 1:
            log(f"sft worked step {step:4d}/{spec.sft_steps} loss {loss:.4f} lr {lr:.2e}")
    acc_worked = greedy_accuracy(model, tok, dev)
    log(f"after phase 1: greedy dev accuracy {acc_worked:.3f}")
    acc, habit_steps = acc_worked, 0
    while acc > spec.habit_target_accuracy and habit_steps < spec.habit_max_steps:
        for _ in range(spec.habit_check_every):
            batch = make_split(rng.randrange(1 << 30), spec.sft_batch_size,
                               spec.max_steps_per_problem, p_direct=spec.habit_p_direct)
            loss = _sft_step(model, opt, tok, batch, spec.habit_lr)
            habit_steps += 1
        acc = greedy_accuracy(model, tok, dev)
        log(f"sft habit step {habit_steps:3d} loss {loss:.4f} greedy dev accuracy {acc:.3f}")
    model.eval()
    return {"sft_final_loss": loss, "dev_accuracy_after_worked": acc_worked,
            "dev_accuracy": acc, "habit_steps": habit_steps}


def build_tiny(out_dir: str | Path, spec: TinyModelSpec, log=print) -> dict:
    """Tokenizer + model + warm start, saved to out_dir. Returns build metadata."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    t0 = time.time()
    tok = save_char_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_config(qwen2_config(spec, tok))
    result = sft(model, tok, spec, log)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out_dir))
    meta = {"spec": asdict(spec), **result, "build_s": time.time() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}
    (out_dir / "build_meta.json").write_text(json.dumps(meta, indent=2))
    return meta
