"""Build an embedded tiny model: a Qwen2-architecture causal LM with a short SFT warm start
(a Llama-architecture one on the production tokenizer: BpeArithSpec).

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
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerBase, Qwen2Config

from areal_ray.task import arith, bpe_tokenizer, chains, tool_arith
from areal_ray.task.tokenizer import BYTE_LEVEL, load_tokenizer, save_char_tokenizer


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
    eval_max_new_tokens: int = 96  # the greedy dev checks' budget


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


@dataclass
class BpeArithSpec(TinyModelSpec):
    """The quickstart's task on the production tokenizer (artifacts/tiny-bpe,
    conf/quickstart_bpe.yaml): a Llama-architecture model whose tokenizer is Mistral's
    SentencePiece (task/bpe_tokenizer.py), each arithmetic prompt a ChatML user turn.

    Trained from scratch, its 32,770-row head makes a warm start like artifacts/tiny's
    (1200 steps of 64) take over an hour on two cores. So it starts from
    artifacts/tiny (`transplant`): the same body, and each token that is one character
    of the char model's alphabet that character's embedding row. What is new is
    little: the ChatML wrapper, the few multi-character tokens arithmetic writes
    (`.\\`, `box`, `ed`) and that the other 32k rows are never written, which a short
    phase 1 teaches; phase 2 is the quickstart's habit. Measured (2 cores, 248 s in
    all, 2 s a step): greedy dev accuracy 0.000 right after the transplant (the char
    model never saw a ChatML turn: the structure is there, the sums drift), 0.789
    after phase 1 (the char model's 0.945 took 1200 steps of 64), 0.227 after 6
    habit steps (the char model's build: 0.227)."""
    task: str = "arith_bpe"
    tokenizer: str = "bpe"
    init_from: str = "artifacts/tiny"
    sft_steps: int = 150
    sft_batch_size: int = 32
    sft_lr: float = 1e-3


@dataclass
class BpeAgentModelSpec(AgentModelSpec):
    """The agents' tool task on the production tokenizer (artifacts/tiny-bpe-agents,
    conf/agents_sdk_bpe.yaml): artifacts/tiny-agents' habit of writing
    `<tool_call>\\n{"name": "calc", "arguments": {"expr": ...}}\\n</tool_call>` carried onto
    Mistral's SentencePiece with ChatML turns (`transplant`, as BpeArithSpec does from
    artifacts/tiny). The prompt is the chat template's rendering of the calculator as the
    OpenAI Agents SDK sends it (SDK_CALC_TOOL: the full JSON schema in the system turn,
    ~200 tokens), so the room for positions grows; the call is 37 tokens, with
    `<tool_call>` five of them. Phase 1's mix is tiny-agents': the greedy answer is direct
    (and wrong), a sampled one calls the tool about a third of the time."""
    task: str = "tool_arith_bpe_hermes"
    tokenizer: str = "bpe"
    init_from: str = "artifacts/tiny-agents"
    max_position_embeddings: int = 512
    # measured: 100 steps of 16 (loss 1.58) left the call unwritable (tool-forced greedy
    # dev accuracy 0.000, the JSON after `<tool_call>` unparsable). 300 steps (loss 0.45,
    # 555 s): forced, the call is written right and parsed, but the boxed answer after the
    # tool's response is not its result copied (dev accuracy still 0.000): not enough yet
    sft_steps: int = 300
    sft_batch_size: int = 16
    sft_lr: float = 1e-3
    dev_size: int = 32
    head_on_labels: bool = True   # label_loss: the same loss, the head at ~1/5 of the positions


SPECS = {"arith": TinyModelSpec, "tool_arith": ToolModelSpec, "tool_arith_hermes": AgentModelSpec,
         "chain_arith": ChainModelSpec, "arith_bpe": BpeArithSpec,
         "tool_arith_bpe_hermes": BpeAgentModelSpec}


def qwen2_config(spec: TinyModelSpec, tok: PreTrainedTokenizerBase) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tok), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)


def llama_config(spec: TinyModelSpec, tok: PreTrainedTokenizerBase) -> LlamaConfig:
    """Qwen2's body as Llama writes it: `attention_bias` gives q, k and v Qwen2's biases
    (and o a bias, kept at zero), so Qwen2 weights load unchanged and compute the same
    logits (tests/task/test_tiny_bpe.py)."""
    q = qwen2_config(spec, tok)
    return LlamaConfig(
        vocab_size=q.vocab_size, hidden_size=q.hidden_size, intermediate_size=q.intermediate_size,
        num_hidden_layers=q.num_hidden_layers, num_attention_heads=q.num_attention_heads,
        num_key_value_heads=q.num_key_value_heads, max_position_embeddings=q.max_position_embeddings,
        rms_norm_eps=q.rms_norm_eps, hidden_act=q.hidden_act, attention_bias=True,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)


def char_rows(bpe_vocab: dict[str, int], char_vocab: dict[str, int],
              specials: dict[str, str]) -> dict[int, int]:
    """BPE id -> char-model id: for each character of the char alphabet, the one BPE
    token SentencePiece writes for it alone (its own piece, `▁` for a space, the byte
    token `<0x0A>` for a newline: no piece of its own), and the `specials` (BPE token ->
    char token: end of turn -> end of text...). One id per character: with tied
    embeddings, two rows alike would split that character's probability."""
    rows = {bpe_vocab[b]: char_vocab[c] for b, c in specials.items()}
    for piece, cid in char_vocab.items():
        if piece in specials.values():
            continue
        ch = {v: k for k, v in BYTE_LEVEL.items()}.get(piece, piece)
        for cand in (("\u2581",) if ch == " " else (ch, f"<0x{ord(ch):02X}>")):
            if cand in bpe_vocab:
                rows[bpe_vocab[cand]] = cid
                break
    return rows


def transplant(char_model, char_tok, bpe_tok, config: LlamaConfig, seed: int):
    """A Llama model on `bpe_tok` that starts as `char_model` did: its body, and its
    embedding row for every BPE token `char_rows` maps. Each other row is the mean of
    the char model's rows for the characters its task never writes (letters), which
    it learned to make unlikely, plus a little noise to tell them apart: at the first
    answer token the mapped rows hold 97% of the probability (zero rows: 67%)."""
    from transformers import LlamaForCausalLM
    specials = {bpe_tok.eos_token: char_tok.eos_token, bpe_tok.pad_token: char_tok.pad_token,
                bpe_tok.bos_token: char_tok.bos_token, bpe_tok.unk_token: char_tok.unk_token}
    rows = char_rows(bpe_tok.get_vocab(), char_tok.get_vocab(), specials)
    state = dict(char_model.state_dict())
    old = state.pop("model.embed_tokens.weight")
    state.pop("lm_head.weight", None)  # tied
    unused = [char_tok.convert_tokens_to_ids(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    g = torch.Generator().manual_seed(seed)
    new = old[unused].mean(0) + old[unused].std(0) * 0.1 * torch.randn(config.vocab_size, old.shape[1], generator=g)
    idx = torch.tensor(sorted(rows))
    new[idx] = old[torch.tensor([rows[i] for i in sorted(rows)])]
    model = LlamaForCausalLM(config)
    for k, v in model.state_dict().items():
        state.setdefault(k, torch.zeros_like(v))  # o_proj's bias: Qwen2 has none
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = new  # tied: both, or one would undo the other
    model.load_state_dict(state)
    return model


def encode_sft(tok, examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) of examples with a `prompt` and
    solution `segments` ((text, trained) pairs); labels cover the trained segments + EOS
    only (a tool's result is in the input, not in the labels). The text is encoded
    whole, as generation sees it (a SentencePiece tokenizer would write each piece
    encoded alone with a word-start `▁`); a token is trained if it starts in a trained
    segment (the offsets)."""
    rows, masks = [], []
    for ex in examples:
        text, trained, pos = ex.prompt, [], len(ex.prompt)
        for seg, is_trained in ex.segments:
            if is_trained:
                trained.append((pos, pos + len(seg)))
            text, pos = text + seg, pos + len(seg)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(a <= s < b for a, b in trained)) for s, _ in enc["offset_mapping"]]
        rows.append(list(enc["input_ids"]) + [tok.eos_token_id])
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


def label_loss(model, ids, att, labels) -> torch.Tensor:
    """The causal LM loss, the head applied only where a label is (HF's applies it at
    every position): on a 32k vocabulary and a 200-token chat prompt whose answer is
    ~50 tokens, the head's logits are most of a step's cost and memory."""
    hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]).float(), target[keep])


def _sft_step(model, opt, tok, batch, lr: float, head_on_labels: bool = False) -> float:
    for g in opt.param_groups:
        g["lr"] = lr
    ids, att, labels = encode_sft(tok, batch)
    if head_on_labels:
        loss = label_loss(model, ids, att, labels)
    else:
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
        return greedy_accuracy(model, tok, dev, self.spec.eval_max_new_tokens)

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


@dataclass(frozen=True)
class ChatExample:
    """A problem as a ChatML user turn (bpe_tokenizer.USER_TURN), its solution the
    assistant's (encode_sft ends it with the end of turn, the tokenizer's eos)."""
    prompt: str
    segments: tuple
    answer: str

    @classmethod
    def of(cls, problem) -> ChatExample:
        return cls(bpe_tokenizer.USER_TURN.format(prompt=problem.prompt), problem.segments, problem.answer)


class ChatArithWarmStart(ArithWarmStart):
    """The quickstart's warm start, each problem a chat turn, as the rollout sees it."""

    def dev(self) -> list:
        return [ChatExample.of(p) for p in super().dev()]

    def batch(self, rng: random.Random, p_direct: float) -> list:
        return [ChatExample.of(p) for p in super().batch(rng, p_direct)]


# The calculator as the OpenAI Agents SDK sends `function_tool(calc)` (examples/
# agents_sdk_agent.py; tests/rollout/workflows/test_agents_sdk.py checks it): a template
# that renders tools' schemas, as the production one does, shows the model exactly this.
SDK_CALC_TOOL = {"type": "function", "function": {
    "name": tool_arith.TOOL, "description": tool_arith.calc.__doc__,
    "parameters": {"properties": {"expr": {"title": "Expr", "type": "string"}}, "required": ["expr"],
                   "title": "calc_args", "type": "object", "additionalProperties": False},
    "strict": True}}


class ChatHermesCalls(tool_arith.HermesCalls):
    """Hermes calls in ChatML turns (the production tokenizer's template): the prompt
    shows the calculator as the Agents SDK sends it (SDK_CALC_TOOL); a tool's result is
    what the template writes after the model's end of turn, from the newline that closes
    it through the next assistant opening (`\\n<|im_start|>user\\n<tool_response>\\n8728
    \\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`), which is the text the endpoint
    appends to the session's ids. (HermesCalls' own cut assumes a template that writes
    no generation prompt: on this one the rendered history never extends it.)"""

    def prompt(self, prompt: str) -> str:
        from areal_ray.rollout.openai.protocol import render_chat
        return render_chat(self.tok, [{"role": "user", "content": prompt}], [SDK_CALC_TOOL])

    def result_text(self, result: str) -> str:
        from areal_ray.rollout.openai.protocol import render_chat
        turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]
        head = self.tok.apply_chat_template(turn, tools=[SDK_CALC_TOOL], tokenize=False,
                                            add_generation_prompt=False)
        full = render_chat(self.tok, turn + [{"role": "tool", "content": result}], [SDK_CALC_TOOL])
        end = head.rfind(self.tok.eos_token) + len(self.tok.eos_token)
        if end < len(self.tok.eos_token) or not full.startswith(head[:end]):
            raise ValueError("the chat template does not end the assistant's turn with the tokenizer's "
                             "eos and append a tool's result after it")
        return full[end:]


class ChatToolWarmStart(ToolWarmStart):
    """ToolWarmStart in ChatML turns (ChatHermesCalls)."""

    def __init__(self, spec: ToolModelSpec, tok=None):
        self.spec = spec
        self.fmt = ChatHermesCalls(tok)


WARM_STARTS = {"arith": ArithWarmStart, "arith_bpe": ChatArithWarmStart, "tool_arith": ToolWarmStart, "tool_arith_hermes": ToolWarmStart,
               "chain_arith": ChainWarmStart, "tool_arith_bpe_hermes": ChatToolWarmStart}


def sft(model, tok, spec: TinyModelSpec, log=print) -> dict:
    if spec.task not in WARM_STARTS:
        raise ValueError(f"task {spec.task!r} is not one of {sorted(WARM_STARTS)}")
    task = WARM_STARTS[spec.task](spec, tok)
    rng = random.Random(spec.seed + 1)
    dev = task.dev()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    head_on_labels = getattr(spec, "head_on_labels", False)
    model.train()
    loss = float("nan")
    for step in range(spec.sft_steps):
        lr = spec.sft_lr * 0.5 * (1 + math.cos(math.pi * step / spec.sft_steps))
        loss = _sft_step(model, opt, tok, task.batch(rng, spec.sft_p_direct), lr, head_on_labels)
        if step % 100 == 0 or step == spec.sft_steps - 1:
            log(f"sft phase 1 step {step:4d}/{spec.sft_steps} loss {loss:.4f} lr {lr:.2e}")
    acc_worked = task.accuracy(model, tok, dev)
    after_1 = {f"{k}_after_phase1": v for k, v in task.report(model, tok, dev).items()}
    log(f"after phase 1: greedy dev accuracy {acc_worked:.3f} {after_1}")
    model.train()
    acc, habit_steps = acc_worked, 0
    while acc > spec.habit_target_accuracy and habit_steps < spec.habit_max_steps:
        for _ in range(spec.habit_check_every):
            loss = _sft_step(model, opt, tok, task.batch(rng, spec.habit_p_direct), spec.habit_lr,
                             head_on_labels)
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
        task = {"tiny": "arith", "tiny-tools": "tool_arith", "tiny-agents": "tool_arith_hermes"}.get(p.name)
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
    bpe = spec.tokenizer == "bpe"
    if bpe:
        bpe_tokenizer.save_bpe_tokenizer(out_dir)
    else:
        save_char_tokenizer(out_dir, spec.tokenizer)
    # The tokenizer as the readers of the model directory load it (the rollout
    # engines, the trainer): trained and checked with exactly those ids (tokenizer.py).
    tok = load_tokenizer(out_dir)
    config = llama_config(spec, tok) if bpe else qwen2_config(spec, tok)
    config.save_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_config(config)
    start = {}
    if spec.init_from:
        init = _init_weights(spec.init_from, log)
        if bpe:  # another vocabulary: the char model's rows where a token is one of its characters
            model = transplant(init, load_tokenizer(init.name_or_path), tok, config, spec.seed)
            task = WARM_STARTS[spec.task](spec, tok)
            start = {"dev_accuracy_at_start": task.accuracy(model, tok, task.dev())}
            log(f"transplanted from {spec.init_from}: greedy dev accuracy {start['dev_accuracy_at_start']:.3f}")
        else:
            init.resize_token_embeddings(len(tok))  # a wider alphabet: its new characters get new rows
            model.load_state_dict(init.state_dict())
    result = {**start, **sft(model, tok, spec, log)}
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(out_dir))
    meta = {"spec": asdict(spec), **result, "build_s": time.time() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}
    (out_dir / "build_meta.json").write_text(json.dumps(meta, indent=2))
    return meta
