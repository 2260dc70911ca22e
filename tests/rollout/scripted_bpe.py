"""A model on the production tokenizer that writes a script of our choosing, token by token.

The interruption, stop-string and streaming tests need outputs that a warm-started
arithmetic model never writes: characters that exist only as byte-fallback tokens, and
words split into pieces other than the ones SentencePiece would choose. This builds a
real one-layer Llama checkpoint on the tiny-bpe tokenizer (artifacts/tiny-bpe's
tokenizer files, copied) whose next token is a fixed function of the current
one: attention and MLP write nothing (zero output projections), so the last hidden
state is the normalised embedding of the current token; the embeddings of the script's
tokens are orthonormal, and the head's row for token b is a large multiple of the
embedding of the token that b follows. After `prompt` the model writes `script` and
starts it again, with a margin of LOGIT nats over every other token: at temperature 1
its draws differ from greedy with probability ~1e-13 a token, so any seed draws the
script and an engine's numerics (batching, a recomputed KV cache) cannot move it.
hf and vLLM load it as any user's checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from areal_ray.task.bpe_tokenizer import USER_TURN

TOKENIZER = Path(__file__).resolve().parents[2] / "artifacts" / "tiny-bpe"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

HIDDEN, HEADS = 64, 2
LOGIT = 40.0
CONTEXT = 1024

# "interrupting" as four pieces (SentencePiece writes ▁interrupt + ing), then 𝔸 (four
# byte-fallback tokens) and ꙮ (three): every boundary inside either is a cut that a
# re-tokenizing resume would corrupt. All tokens distinct: the next one is a function
# of the current one.
WORD = ["▁in", "ter", "rup", "ting"]
CHARS = ["<0xF0>", "<0x9D>", "<0x94>", "<0xB8>", "<0xEA>", "<0x99>", "<0xAE>"]
SCRIPT = WORD + CHARS
PROMPT = USER_TURN.format(prompt="Say it.")


def build(out: str | Path, script: list[str] = SCRIPT, prompt: str = PROMPT) -> tuple[str, list[int], list[int]]:
    """Write the model to `out`: (its path, the prompt's ids, the script's ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out = Path(out)
    for name in TOKENIZER_FILES:  # committed; building them (bpe_tokenizer) takes seconds
        shutil.copy(TOKENIZER / name, out / name)
    tok = AutoTokenizer.from_pretrained(str(out))
    vocab = tok.get_vocab()
    ids = [vocab[p] for p in script]
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    chain = [prompt_ids[-1]] + ids
    if len(set(chain)) != len(chain):
        raise ValueError(f"script tokens must be distinct and not the prompt's last: {script}")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, rms_norm_eps=1e-6, dtype="float32")
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(HIDDEN, len(chain), generator=g))  # orthonormal columns
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 0.02, generator=g)  # other tokens: anything, they are never written
        for j, t in enumerate(chain):
            emb[t] = basis[:, j]
        # the normalised hidden state of token chain[j] is sqrt(HIDDEN) * basis[:, j]
        head = model.lm_head.weight
        nxt = {chain[j]: chain[j + 1] if j + 1 < len(chain) else chain[1] for j in range(len(chain))}
        for a, b in nxt.items():
            head[b] += LOGIT / HIDDEN ** 0.5 * emb[a]
    model.save_pretrained(str(out))
    return str(out), prompt_ids, ids
