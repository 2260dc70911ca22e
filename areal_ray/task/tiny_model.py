"""Build an embedded tiny model: a Qwen2-architecture causal LM with a short SFT warm start.

The warm start has two phases, the same for both embedded tasks (`spec.task`, a
`WarmStart` below). Phase 1 teaches the solution format: worked arithmetic for
`arith` (about 95% greedy accuracy); for `tool_arith` both the calculator call and
the direct answer (areal_ray/task/tool_arith.py), so the call format is known. Phase 2,
a few steps on data dominated by bare answers, gives the model the habit of answering
without showing work (or without the tool). It stops as soon as greedy accuracy on a
dev split falls to `habit_target_accuracy`, so RL starts from a modest, non-zero
accuracy with a real behaviour to learn: that working the problem out (calling the
tool) pays. (A fixed step count landed anywhere between 3% and 20% depending on the
data stream.) The tool task's dev accuracy is measured the way RL sees it: multi-turn,
the calculator's result appended after each call. The result is saved with
`save_pretrained` and is an ordinary HF model directory, loadable by transformers' Auto
classes (and by SGLang on a GPU).
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

from areal_ray.task import arith, chains, tool_arith
from areal_ray.task.tokenizer import load_tokenizer, save_char_tokenizer


@dataclass
class TinyModelSpec:
    task: str = "arith"           # which warm start (WARM_STARTS): arith | tool_arith | tool_arith_hermes | chain_arith
    init_from: str = ""           # start from this model's weights (relative: to the repo root), else from scratch
    tokenizer: str = "char"       # tokenizer.CHAR_TOKENIZERS: char | hermes (a wider alphabet: init_from's ids are kept)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    max_position_embeddings: int = 256
    seed: int = 0
    sft_steps: int = 1200         # phase 1: cosine from sft_lr
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    sft_p_direct: float = 0.0     # phase 1's share of direct (bare-answer) solutions
    max_steps_per_problem: int = 8
    habit_max_steps: int = 60     # phase 2: a mix dominated by bare answers, constant habit_lr,
    habit_lr: float = 3e-4        # until greedy dev accuracy falls to habit_target_accuracy
    habit_p_direct: float = 0.8
    habit_target_accuracy: float = 0.25
    habit_check_every: int = 3
    dev_size: int = 128


@dataclass
class ToolModelSpec(TinyModelSpec):
    """The tool-use task's model (artifacts/tiny-tools): same dimensions, its own warm start."""
    task: str = "tool_arith"
    call_format: str = "calc"     # tool_arith.call_format: calc | hermes
    sft_steps: int = 600
    sft_p_direct: float = 0.5
    habit_p_direct: float = 0.9
    habit_target_accuracy: float = 0.2


@dataclass
class AgentModelSpec(ToolModelSpec):
    """The tool task for agent frameworks (artifacts/tiny-agents, conf/agents_sdk.yaml):
    calls in Hermes / Qwen2.5's `<tool_call>{json}</tool_call>` format, rendered by the
    `hermes` char tokenizer's chat template (tool_arith.HermesCalls), so the endpoint's
    hermes parser turns them into `tool_calls`. It starts from artifacts/tiny-tools
    (its ids are kept; the JSON characters are new rows), which already copies the sum
    into a call and the result into the box: only the format is new."""
    task: str = "tool_arith_hermes"
    tokenizer: str = "hermes"
    call_format: str = "hermes"
    init_from: str = "artifacts/tiny-tools"
    sft_steps: int = 300
    # measured (128 dev problems, greedy): a 0.5 mix called the tool on 55% (accuracy 0.48),
    # and 3 habit steps at 3e-4 then took it to 0; this 0.7 mix calls it on none (accuracy
    # 0.000, 0.891 with the call forced): the greedy choice flips on all problems at once
    sft_p_direct: float = 0.7
    habit_lr: float = 1e-4
    habit_check_every: int = 1


@dataclass
class ChainModelSpec(TinyModelSpec):
    """The long-chain task's model (artifacts/tiny-chains, areal_ray/task/chains.py).

    It starts from the quickstart's model (same tokenizer ids for every character the
    chains use, same dimensions), which already works short chains. Phase 1 trains it
    on long chains, in length-sorted batches (little padding), to keep going for
    fifty steps. Phase 2 gives it the habit of quitting early: a mix dominated by
    solutions cut after a random step, boxing the running total there
    (chains.quit_early), so it stops working before the chain ends and is wrong for
    it. RL then has one clear thing to learn, shared by every problem of more than one
    step, as in the quickstart (work it out) but without cutting the length tail: keep
    going to the end; outputs grow longer as it learns, as a reasoning model's do.
    Measured (conf/longtail.yaml, 40 steps): greedy accuracy 0.188 -> 0.422. Without
    phase 2 the RL signal is only the precision of each step, spread over hundreds of
    tokens: accuracy stayed flat, 0.352 -> 0.344 (at 5x the lr the policy collapsed,
    -> 0.023). The cost: the habit shortens the warm start's samples (p90 81 tokens in
    the first steps, against 234 without it; 51 with 0.7 quitting); they lengthen as
    RL unlearns it. Phase 2 is
    a fixed number of steps checked once: a greedy check of long answers costs a
    minute on two cores. RoPE has no learned positions, so a larger
    max_position_embeddings loads the same weights."""
    task: str = "chain_arith"
    init_from: str = "artifacts/tiny"
    max_position_embeddings: int = 768
    sft_steps: int = 120
    sft_batch_size: int = 32
    sft_lr: float = 1e-3
    max_steps_per_problem: int = chains.MAX_STEPS
    habit_max_steps: int = 12     # the share that quits early: habit_p_direct (sft_p_direct: 0)
    habit_check_every: int = 12
    habit_p_direct: float = 0.4   # measured: 0.4 RL 0.188 -> 0.422; 0.7 cut the tail (p90 51) and 0.070 -> 0.219
    habit_target_accuracy: float = 0.25
    dev_size: int = 64
    length_pool: int = 8          # a batch is a length-sorted run of sft_batch_size out of this many batches' problems
    eval_max_new_tokens: int = 448


SPECS = {"arith": TinyModelSpec, "tool_arith": ToolModelSpec, "tool_arith_hermes": AgentModelSpec,
         "chain_arith": ChainModelSpec}


def qwen2_config(spec: TinyModelSpec, tok: PreTrainedTokenizerBase) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tok), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)


def encode_sft(tok, examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) of examples with a `prompt` and
    solution `segments` ((text, trained) pairs); labels cover the trained segments + EOS
    only (a tool's result is in the input, not in the labels)."""
    rows, masks = [], []
    for ex in examples:
        prompt = tok(ex.prompt, add_special_tokens=False)["input_ids"]
        row, mask = list(prompt), [0] * len(prompt)
        for text, trained in ex.segments:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            row += ids
            mask += [int(trained)] * len(ids)
        rows.append(row + [tok.eos_token_id])
        masks.append(mask + [1])
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
def greedy_accuracy(model, tok, problems: list[arith.ArithProblem], max_new_tokens: int = 96,
                    grade=None) -> float:
    """Share of `problems` whose greedy answer `grade(text, answer)` scores (default: math)."""
    from areal_ray.reward.math import math_reward

    grade = grade or math_reward
    model.eval()
    enc = tok([p.prompt for p in problems], add_special_tokens=False, padding=True,
              return_tensors="pt")
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train()
    return sum(grade(t, p.answer) for t, p in zip(texts, problems)) / len(problems)


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


class ArithWarmStart:
    """Worked chains in phase 1, bare answers in phase 2 (areal_ray/task/arith.py)."""

    def __init__(self, spec: TinyModelSpec, tok=None):
        self.spec = spec

    def dev(self) -> list:
        return arith.make_split(self.spec.seed + 7_000_000, self.spec.dev_size,
                                self.spec.max_steps_per_problem)

    def batch(self, rng: random.Random, p_direct: float) -> list:
        return arith.make_split(rng.randrange(1 << 30), self.spec.sft_batch_size,
                                self.spec.max_steps_per_problem, p_direct=p_direct)

    def accuracy(self, model, tok, dev: list) -> float:
        return greedy_accuracy(model, tok, dev)

    def report(self, model, tok, dev: list) -> dict:
        return {}


class ToolWarmStart:
    """Calls and direct answers in phase 1, mostly direct answers in phase 2
    (areal_ray/task/tool_arith.py); accuracy is multi-turn greedy, the tool's result
    appended after each call, as the rollout workflow does; in the spec's call format
    (tool_arith.CalcCalls, HermesCalls)."""

    def __init__(self, spec: ToolModelSpec, tok=None):
        self.spec = spec
        self.fmt = tool_arith.call_format(spec.call_format, tok)

    def dev(self) -> list:
        return tool_arith.make_split(self.spec.seed + 7_000_000, self.spec.dev_size)

    def batch(self, rng: random.Random, p_direct: float) -> list:
        return tool_arith.examples(random.Random(rng.randrange(1 << 30)),
                                   self.spec.sft_batch_size, p_direct, self.fmt)

    def accuracy(self, model, tok, dev: list) -> float:
        return tool_arith.tool_accuracy(model, tok, dev, fmt=self.fmt)[0]

    def report(self, model, tok, dev: list) -> dict:
        """Greedy accuracy as it is (with its tool-use rate), with the tool forced,
        and with a direct answer forced: what the model can do either way."""
        acc, rate = tool_arith.tool_accuracy(model, tok, dev, fmt=self.fmt)
        forced = tool_arith.tool_accuracy(model, tok, dev, prefix=self.fmt.call_prefix, fmt=self.fmt)[0]
        direct = tool_arith.tool_accuracy(model, tok, dev, prefix="\\boxed{", fmt=self.fmt)[0]
        return {"dev_tool_rate": rate, "dev_accuracy_tool_forced": forced,
                "dev_accuracy_direct_forced": direct}


class ChainWarmStart:
    """Long worked chains (areal_ray/task/chains.py), graded by the strict `chain`
    verifier. A batch is a random run of `sft_batch_size` problems out of a
    length-sorted pool of `length_pool` batches' worth: each problem is as likely to
    be trained as in an unsorted batch, with a fraction of the padding (a run of
    short chains costs little, so the build stays within minutes on two cores)."""

    def __init__(self, spec: TinyModelSpec, tok=None):
        self.spec = spec

    def dev(self) -> list:
        return chains.make_split(self.spec.seed + 7_000_000, self.spec.dev_size,
                                 max_steps=self.spec.max_steps_per_problem)

    def batch(self, rng: random.Random, p_direct: float) -> list:
        n, pool = self.spec.sft_batch_size, self.spec.length_pool
        # the phases' share of "direct" solutions is, for this task, the share that
        # quit early (chains.quit_early): a bare answer would cut the tail
        probs = chains.make_split(rng.randrange(1 << 30), n * pool,
                                  max_steps=self.spec.max_steps_per_problem, p_quit=p_direct)
        probs.sort(key=lambda p: len(p.prompt) + len(p.solution))
        start = rng.randrange(pool) * n
        return probs[start: start + n]

    def accuracy(self, model, tok, dev: list) -> float:
        return greedy_accuracy(model, tok, dev, self.spec.eval_max_new_tokens, chains.grade)

    def report(self, model, tok, dev: list) -> dict:
        return {}


WARM_STARTS = {"arith": ArithWarmStart, "tool_arith": ToolWarmStart, "tool_arith_hermes": ToolWarmStart,
               "chain_arith": ChainWarmStart}


def sft(model, tok, spec: TinyModelSpec, log=print) -> dict:
    if spec.task not in WARM_STARTS:
        raise ValueError(f"task {spec.task!r} is not one of {sorted(WARM_STARTS)}")
    task = WARM_STARTS[spec.task](spec, tok)
    rng = random.Random(spec.seed + 1)
    dev = task.dev()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for step in range(spec.sft_steps):
        lr = spec.sft_lr * 0.5 * (1 + math.cos(math.pi * step / spec.sft_steps))
        loss = _sft_step(model, opt, tok, task.batch(rng, spec.sft_p_direct), lr)
        if step % 100 == 0 or step == spec.sft_steps - 1:
            log(f"sft phase 1 step {step:4d}/{spec.sft_steps} loss {loss:.4f} lr {lr:.2e}")
    acc_worked = task.accuracy(model, tok, dev)
    after_1 = {f"{k}_after_phase1": v for k, v in task.report(model, tok, dev).items()}
    log(f"after phase 1: greedy dev accuracy {acc_worked:.3f} {after_1}")
    model.train()
    acc, habit_steps = acc_worked, 0
    while acc > spec.habit_target_accuracy and habit_steps < spec.habit_max_steps:
        for _ in range(spec.habit_check_every):
            loss = _sft_step(model, opt, tok, task.batch(rng, spec.habit_p_direct), spec.habit_lr)
            habit_steps += 1
        acc = task.accuracy(model, tok, dev)
        model.train()
        log(f"sft habit step {habit_steps:3d} loss {loss:.4f} greedy dev accuracy {acc:.3f}")
    model.eval()
    final = task.report(model, tok, dev)
    if final:
        log(f"after phase 2: {final}")
    return {"sft_final_loss": loss, "dev_accuracy_after_worked": acc_worked,
            "dev_accuracy": acc, "habit_steps": habit_steps, **after_1, **final}


def _init_weights(path: str, log=print):
    """The model a warm start begins from; an embedded one (SPECS) is built if missing."""
    p = Path(path)
    if not p.is_absolute():
        p = Path(__file__).resolve().parents[2] / p
    if not (p / "config.json").exists():
        task = {"tiny": "arith", "tiny-tools": "tool_arith"}.get(p.name)
        if task is None:
            raise FileNotFoundError(f"init_from {path!r}: no model (config.json) in {p}")
        log(f"building {p} first: the warm start begins from it")
        build_tiny(p, SPECS[task](), log)
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)


def build_tiny(out_dir: str | Path, spec: TinyModelSpec, log=print) -> dict:
    """Tokenizer + model + warm start, saved to out_dir. Returns build metadata."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    t0 = time.time()
    config = qwen2_config(spec, save_char_tokenizer(out_dir, spec.tokenizer))
    config.save_pretrained(str(out_dir))
    # The tokenizer as the readers of the model directory load it (the rollout
    # engines, the trainer): trained and checked with exactly those ids (tokenizer.py).
    tok = load_tokenizer(out_dir)
    model = AutoModelForCausalLM.from_config(config)
    if spec.init_from:
        init = _init_weights(spec.init_from, log)
        init.resize_token_embeddings(len(tok))  # a wider alphabet: its new characters get new rows
        model.load_state_dict(init.state_dict())
    result = sft(model, tok, spec, log)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out_dir))
    meta = {"spec": asdict(spec), **result, "build_s": time.time() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}
    (out_dir / "build_meta.json").write_text(json.dumps(meta, indent=2))
    return meta
