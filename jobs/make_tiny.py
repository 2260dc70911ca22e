"""Entry point: build the embedded tiny model (tokenizer, Qwen2-style LM, SFT warm start).

    python -m jobs.make_tiny [out=artifacts/tiny] [sft_steps=...] [hidden_size=...]
    python -m jobs.make_tiny task=tool_arith out=artifacts/tiny-tools
    python -m jobs.make_tiny task=tool_arith_hermes out=artifacts/tiny-agents
    python -m jobs.make_tiny task=chain_arith out=artifacts/tiny-chains
    python -m jobs.make_tiny task=arith_bpe out=artifacts/tiny-bpe
    python -m jobs.make_tiny task=tool_arith_bpe_hermes out=artifacts/tiny-bpe-agents

`task` picks the warm start and its defaults (tiny_model.SPECS: `arith`, the
quickstart's model; `tool_arith`, the tool-use model of conf/tools.yaml;
`tool_arith_hermes`, the same task in Hermes / Qwen's `<tool_call>` format for agent
frameworks (conf/agents_sdk.yaml), which starts from artifacts/tiny-tools; `chain_arith`,
the long-chain model of conf/longtail.yaml, which starts from artifacts/tiny; `arith_bpe`,
the quickstart's task on a production tokenizer (Mistral's SentencePiece, ChatML turns;
a Llama model; conf/quickstart_bpe.yaml), which also starts from artifacts/tiny;
`tool_arith_bpe_hermes`, the agents' tool task on that tokenizer (conf/agents_sdk_bpe.yaml),
which starts from artifacts/tiny-agents); every
other key is a field of that spec.

The result is deterministic for a given spec and seed, and small enough to commit,
so the quickstart starts training at once; `jobs.train` also builds it on first use.
"""

from __future__ import annotations

import sys
from dataclasses import fields

from omegaconf import OmegaConf

from areal_ray.task.tiny_model import SPECS, build_tiny

DEFAULT_OUT = {"arith": "artifacts/tiny", "tool_arith": "artifacts/tiny-tools",
               "tool_arith_hermes": "artifacts/tiny-agents", "chain_arith": "artifacts/tiny-chains",
               "arith_bpe": "artifacts/tiny-bpe", "tool_arith_bpe_hermes": "artifacts/tiny-bpe-agents"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, task = None, "arith"
    rest = []
    for a in argv:
        if a.startswith("out="):
            out = a.split("=", 1)[1]
        elif a.startswith("task="):
            task = a.split("=", 1)[1]
        else:
            rest.append(a)
    if task not in SPECS:
        print(f"task={task}: not one of {sorted(SPECS)}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in rest):
        print(__doc__ + f"\nkeys (task={task}'s spec, {SPECS[task].__name__}) and their defaults:")
        print("\n".join(f"  {f.name} = {f.default!r}" for f in fields(SPECS[task])))
        return 0
    out = out or DEFAULT_OUT[task]
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SPECS[task]),
                                               OmegaConf.from_dotlist(rest)))
    meta = build_tiny(out, spec)
    print(f"built {out}: {meta['n_params']} parameters, greedy dev accuracy {meta['dev_accuracy']:.3f} "
          f"({meta['habit_steps']} habit steps), "
          f"{meta['build_s']:.0f}s")
    extra = {k: round(v, 3) for k, v in meta.items() if k.startswith("dev_") and k != "dev_accuracy"}
    if extra:
        print(f"  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
