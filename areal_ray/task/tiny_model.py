"""Build the embedded tiny model: a Qwen2-architecture causal LM with a short SFT warm start.

The warm start has two phases. Phase 1 teaches worked arithmetic (about 95% greedy
accuracy). Phase 2, a few steps on data dominated by bare answers (see
areal_ray/task/arith.py), gives the model the habit of answering without showing
work, so RL starts from a modest, non-zero accuracy (~20%) with a real behaviour to
learn: that working the problem out pays. The result is saved with `save_pretrained` and is an ordinary HF
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
    sft_steps: int = 700          # phase 1: worked solutions only, cosine from sft_lr
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    max_steps_per_problem: int = 8
    habit_steps: int = 25         # phase 2: a mix dominated by bare answers, constant habit_lr
    habit_lr: float = 3e-4
    habit_p_direct: float = 0.8


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


def sft(model, tok, spec: TinyModelSpec, log=print) -> list[float]:
    rng = random.Random(spec.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    phases = [("worked", spec.sft_steps, 0.0), ("habit", spec.habit_steps, spec.habit_p_direct)]
    losses = []
    model.train()
    for name, n_steps, p_direct in phases:
        for step in range(n_steps):
            lr = (spec.sft_lr * 0.5 * (1 + math.cos(math.pi * step / n_steps))
                  if name == "worked" else spec.habit_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = make_split(rng.randrange(1 << 30), spec.sft_batch_size,
                               spec.max_steps_per_problem, p_direct=p_direct)
            ids, att, labels = encode_sft(tok, batch)
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if step % 100 == 0 or step == n_steps - 1:
                log(f"sft {name} step {step:4d}/{n_steps} loss {loss.item():.4f} lr {lr:.2e}")
    model.eval()
    return losses


def build_tiny(out_dir: str | Path, spec: TinyModelSpec, log=print) -> dict:
    """Tokenizer + model + warm start, saved to out_dir. Returns build metadata."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    t0 = time.time()
    tok = save_char_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_config(qwen2_config(spec, tok))
    losses = sft(model, tok, spec, log)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out_dir))
    meta = {"spec": asdict(spec), "sft_final_loss": losses[-1], "build_s": time.time() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}
    (out_dir / "build_meta.json").write_text(json.dumps(meta, indent=2))
    return meta
