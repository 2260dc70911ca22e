"""Entry point: build the embedded tiny model (tokenizer, Qwen2-style LM, SFT warm start).

    python -m jobs.make_tiny [out=artifacts/tiny] [sft_steps=...] [hidden_size=...]

The result is deterministic for a given spec and seed, and small enough to commit,
so the quickstart starts training at once; `jobs.train` also builds it on first use.
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from areal_ray.task.tiny_model import TinyModelSpec, build_tiny


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = "artifacts/tiny"
    rest = []
    for a in argv:
        if a.startswith("out="):
            out = a.split("=", 1)[1]
        else:
            rest.append(a)
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TinyModelSpec),
                                               OmegaConf.from_dotlist(rest)))
    meta = build_tiny(out, spec)
    print(f"built {out}: {meta['n_params']} parameters, greedy dev accuracy {meta['dev_accuracy']:.3f} "
          f"({meta['habit_steps']} habit steps), "
          f"{meta['build_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
