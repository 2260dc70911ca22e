"""The embedded judge and reward model, built on first use (minutes on a busy CPU).

Both read what the default templates render, `<reference>:<answer>`, each right-aligned in three columns (the row's answer
and the sample's last `\\boxed{}` answer, numbers of the embedded arithmetic task), and
both learned one rule: whether the two agree. The judge (`artifacts/tiny-judge`, a
causal LM on the char tokenizer) writes `1` or `0` after a `?`; the reward model
(`artifacts/tiny-rm`, a sequence-classification model with one label) gives a logit
whose sigmoid is the reward. So a run rewarded by either learns the task as it does
from the `math` checker, through the served path: a Serve app per model, batched
calls, deadlines. Built deterministically (seeded data and init), into a temporary dir
renamed into place, so processes building at once never read half a model.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = {"artifacts/tiny-judge": "judge", "artifacts/tiny-rm": "reward_model"}
KIND_KEYS = {"judge": "reward.judge.model", "reward_model": "reward.reward_model.model"}
# the reward model's head learns the rule in fewer steps than the judge's next token
STEPS = {"judge": 1000, "reward_model": 600}
BATCH, LR, WARMUP, SEED = 64, 5e-3, 50, 0
MAX_NUMBER = 99  # the embedded task's running totals stay in [0, 99] (task/arith.py)
# What the default templates render (config/judge.py): both numbers right-aligned in
# three columns, so each digit faces its counterpart at a fixed distance. (Unaligned,
# the judge was at chance after 200 steps and 0.70 after 400; aligned, 0.89 after 1000.)
JUDGE_PROMPT = "{reference:>3}:{answer:>3}?"
RM_TEXT = "{reference:>3}:{answer:>3}"


def pair(rng: random.Random) -> tuple[str, str, bool]:
    """(reference, answer, agree): half agree; the rest a near miss (a digit off, the
    digits swapped), another number, or no answer at all."""
    ref = rng.randint(0, MAX_NUMBER)
    if rng.random() < 0.5:
        return str(ref), str(ref), True
    r = rng.random()
    if r < 0.1:
        ans = ""
    elif r < 0.55:
        ans = str(min(max(ref + rng.choice((-10, -2, -1, 1, 2, 10)), 0), 199))
    elif r < 0.65 and ref >= 10:
        ans = str(ref)[::-1]
    else:
        ans = str(rng.randint(0, MAX_NUMBER))
    return str(ref), ans, ans == str(ref)


def _config(tok):
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=192,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=256, tie_word_embeddings=True,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, num_labels=1)


def _batch(tok, rng: random.Random, kind: str):
    import torch
    pairs = [pair(rng) for _ in range(BATCH)]
    if kind == "reward_model":
        enc = tok([RM_TEXT.format(reference=r, answer=a) for r, a, _ in pairs],
                  add_special_tokens=False, padding=True, return_tensors="pt")
        return enc, torch.tensor([[float(ok)] for _, _, ok in pairs])
    rows = [tok(JUDGE_PROMPT.format(reference=r, answer=a) + str(int(ok)),
                add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for r, a, ok in pairs]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    att = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):  # only the verdict and EOS are trained
        ids[i, :len(r)], att[i, :len(r)] = torch.tensor(r), 1
        labels[i, len(r) - 2:len(r)] = torch.tensor(r[-2:])
    return {"input_ids": ids, "attention_mask": att}, labels


def accuracy(model, tok, kind: str, n: int = 512, seed: int = SEED + 99) -> float:
    """Share of `n` fresh pairs the model gets right (greedy verdict / logit sign)."""
    import torch
    rng = random.Random(seed)
    pairs = [pair(rng) for _ in range(n)]
    model.eval()
    with torch.no_grad():
        if kind == "reward_model":
            enc = tok([RM_TEXT.format(reference=r, answer=a) for r, a, _ in pairs],
                      add_special_tokens=False, padding=True, return_tensors="pt")
            said = (model(**enc).logits[:, 0] > 0).tolist()
        else:
            tok.padding_side = "left"
            enc = tok([JUDGE_PROMPT.format(reference=r, answer=a) for r, a, _ in pairs],
                      add_special_tokens=False, padding=True, return_tensors="pt")
            logits = model(**enc).logits[:, -1]
            one, zero = tok.convert_tokens_to_ids(["1", "0"])
            said = (logits[:, one] > logits[:, zero]).tolist()
    return sum(s == ok for s, (_, _, ok) in zip(said, pairs)) / n


def build(out_dir: str | Path, kind: str, log=print) -> dict:
    """Train the embedded `kind` ("judge" or "reward_model") and save it to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from areal_ray.task.tokenizer import load_tokenizer, save_char_tokenizer
    out_dir = Path(out_dir)
    t0 = time.time()
    torch.manual_seed(SEED)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        save_char_tokenizer(tmp)
        tok = load_tokenizer(tmp)
        config = _config(tok)
        auto = AutoModelForSequenceClassification if kind == "reward_model" else AutoModelForCausalLM
        model = auto.from_config(config)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        rng, loss = random.Random(SEED + 1), float("nan")
        model.train()
        steps = STEPS[kind]
        for step in range(steps):
            for g in opt.param_groups:  # linear warm-up, then linear decay: a stable end
                g["lr"] = LR * min((step + 1) / WARMUP, 1 - step / steps)
            inputs, target = _batch(tok, rng, kind)
            if kind == "reward_model":
                logits = model(**inputs).logits
                loss_t = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
            else:
                loss_t = model(**inputs, labels=target).loss
            opt.zero_grad()
            loss_t.backward()
            opt.step()
            loss = loss_t.item()
            if step % 100 == 0:
                log(f"[areal-ray] {kind} build step {step}/{steps} loss {loss:.4f}")
        acc = accuracy(model, tok, kind)
        if kind == "judge":
            model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(str(tmp))
        meta = {"kind": kind, "steps": steps, "final_loss": loss, "accuracy": acc,
                "build_s": time.time() - t0, "n_params": sum(p.numel() for p in model.parameters())}
        (tmp / "build_meta.json").write_text(json.dumps(meta, indent=2))
        log(f"[areal-ray] built the embedded {kind} in {out_dir}: rule accuracy {acc:.3f} "
            f"in {meta['build_s']:.0f}s")
        try:
            os.rename(tmp, out_dir)  # atomic: another process's build may have won
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve(path: str, kind: str) -> str:
    """Absolute dir of a served reward's model; the embedded ones (EMBEDDED) are built
    on first use; another path without config.json is an error naming the key."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    embedded = EMBEDDED.get(Path(path).as_posix())
    if not (p / "config.json").exists():
        if embedded != kind:
            raise FileNotFoundError(f"{KIND_KEYS[kind]} {path!r}: no HF model (config.json) there")
        p = REPO_ROOT / path if not p.is_absolute() else p
        p.parent.mkdir(parents=True, exist_ok=True)
        build(p, kind)
    return str(p.resolve())


def resolve_all(reward) -> dict[str, str]:
    """kind -> model dir of each enabled served reward (`reward.judge`,
    `reward.reward_model`), built or checked before the cluster is touched."""
    sections = {"judge": reward.judge, "reward_model": reward.reward_model}
    return {k: resolve(c.model, k) for k, c in sections.items() if c.enabled}
