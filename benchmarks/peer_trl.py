"""TRL's GRPOTrainer on our quickstart (or any embedded-task config, e.g. conf/longtail.yaml),
for `benchmarks/bench_peers.py` (run in its own process).

    PYTHONPATH=.peers/site python -m benchmarks.peer_trl seed=0 steps=40 out=runs/peers/trl-0

The settings are the quickstart's (conf/quickstart.yaml): the same model, the same
prompts in the same order (`train_rows`, `shuffle_dataset=False`), the same prompt
text (plain strings: no chat template), the same reward function (each row's verifier,
by our checker registry: `math` for the quickstart, `chain` for conf/longtail.yaml), 8 prompts x 8
completions per optimizer step, AdamW at a constant lr with betas (0.9, 0.95), grad
clip 1.0, clip eps 0.2, no KL (no reference model is loaded), token-mean loss over the
batch ("dapo", as ours), group-normalised advantages, the full sampling distribution
at temperature 1, fp32 on the CPU. TRL is synchronous and on-policy (one PPO update
per generation), like our `algo.eta=0`.

Writes `result.json`: seconds of training (`trainer.train()`), per-step rows (end time
since the start of training and wall clock, seconds inside the model's `generate`, reward,
mean and longest completion length) and the models
saved every `save_every` steps (with those times), which the bench evaluates
afterwards with our own evaluator. Saving is not counted as training.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from areal_ray.config import opt
from jobs.cli import job_config


@dataclass
class PeerTRLConfig:
    seed: int = opt(0, "seed of TRL's trainer (ours: train.seed)")
    steps: int = opt(40, "optimizer steps")
    save_every: int = opt(10, "save the model every N steps for the time-to-accuracy curve (0: final only)")
    threads: int = opt(2, "torch threads of the TRL process")
    config: str = opt("conf/quickstart.yaml", "our run config the settings come from")
    out: str = opt("runs/peers/trl", "output directory")


def run(c: PeerTRLConfig) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_ray.config import load_config
    from areal_ray.data.prompts import train_rows
    from areal_ray.reward.registry import CheckerRegistry
    from areal_ray.run.job import resolve_model
    from areal_ray.task.tokenizer import load_tokenizer

    torch.set_num_threads(c.threads)
    cfg = load_config(c.config, [])
    B, G = cfg.algo.batch_groups, cfg.rollout.group_size
    path = resolve_model(cfg.model.path)
    out = Path(c.out)
    rows = train_rows(cfg.task, c.steps * B)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"], "verifier": r["verifier"]}
                            for r in rows])
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    checkers = CheckerRegistry(dict(cfg.reward.checkers))

    def reward(prompts, completions, answer, verifier, **kwargs):
        return [_score(checkers.check(v, c_, a)) for c_, a, v in zip(completions, answer, verifier)]

    steps, saved = [], []
    t_start = [0.0]
    generate_s = [0.0]  # seconds inside the model's `generate` since the last step ended

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append({"step": state.global_step - 1, "t": time.perf_counter() - t_start[0],
                          "t_wall": time.time(), "generate_s": generate_s[0]})
            generate_s[0] = 0.0
            if c.save_every and state.global_step % c.save_every == 0 and state.global_step < c.steps:
                t0 = time.perf_counter()
                d = out / f"model-step{state.global_step}"
                trainer.model.save_pretrained(d)
                tok.save_pretrained(d)
                t_start[0] += time.perf_counter() - t0  # saving for the bench is not training
                saved.append({"step": state.global_step, "t": steps[-1]["t"],
                              "t_wall": steps[-1]["t_wall"], "path": str(d)})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and steps:
                steps[-1].update(reward=logs["reward"], mean_len=logs.get("completions/mean_length"),
                                 max_len=logs.get("completions/max_length"))

    a = cfg.algo
    args = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=c.steps, per_device_train_batch_size=B * G,
        gradient_accumulation_steps=1, num_generations=G, num_iterations=1, beta=0.0,
        epsilon=a.loss.eps_clip, loss_type="dapo", scale_rewards="group",
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=1.0, top_k=0, learning_rate=a.optim.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        weight_decay=a.optim.weight_decay, max_grad_norm=a.optim.max_grad_norm, use_cpu=True, bf16=False,
        fp16=False, gradient_checkpointing=False, seed=c.seed, shuffle_dataset=False,
        remove_unused_columns=False, dataloader_num_workers=0, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, mask_truncated_completions=False,
        disable_dropout=True, use_vllm=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Record()])
    model.generate = _timed(model.generate, generate_s)  # TRL generates with the model itself on CPU
    t_start[0] = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_start[0]
    if not any(s["generate_s"] for s in steps):
        raise RuntimeError("no time was counted inside generate: TRL no longer calls model.generate")
    final = out / "final_model"
    trainer.model.config.use_cache = True
    trainer.model.save_pretrained(final)
    tok.save_pretrained(final)
    saved.append({"step": c.steps, "t": train_s, "t_wall": steps[-1]["t_wall"], "path": str(final)})
    result = {"system": "trl", "seed": c.seed, "train_s": train_s, "n_samples": c.steps * B * G,
              "steps": steps, "models": saved}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _timed(fn, acc: list):
    """`fn`, adding the seconds of each call to acc[0]."""
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t0
    return timed


def _score(result) -> float:
    """A checker's reward: it returns (reward, reason) or a bare reward."""
    return float(result[0] if isinstance(result, tuple) else result)


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m benchmarks.peer_trl", __doc__.split("\n\n")[0], PeerTRLConfig)
    if c is None:
        return 2
    Path(c.out).mkdir(parents=True, exist_ok=True)
    run(c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
