"""`sft.*`: supervised fine-tuning (`python -m jobs.sft`): its rows, batch and length.

The SFT job runs on the RL trainer's pieces and reads their keys too: `model.*` (the
model it starts from), `train.*` (workers, `steps`, checkpoints), `algo.optim` (lr,
schedule, weight decay, gradient clip), `algo.microbatch` (the token budget of a
micro-batch) and `run.*` (run dir, resume). What only SFT has is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.section import opt, require


@dataclass(kw_only=True)
class SftConfig:
    train_path: str = opt("", "jobs.sft: rows {prompt, completion} or {messages: [..., {role: assistant, content}]} (jsonl, parquet, arrow, a directory or a glob); empty: the embedded arith task's worked solutions")
    eval_path: str = opt("", "jobs.sft: held-out rows of the same forms for the eval loss; empty: the embedded task on a disjoint seed, or with a train_path its last n_eval rows (left out of training)")
    n_train: int = opt(4096, "jobs.sft, embedded data: training rows generated")
    n_eval: int = opt(128, "jobs.sft: held-out rows (embedded: generated; with a train_path and no eval_path: its last ones)")
    p_direct: float = opt(0.0, "jobs.sft, embedded data: share of solutions that are the bare boxed answer (the warm start's phase 1: 0)")
    epochs: float = opt(0.0, "jobs.sft: passes over the training rows (sets train.steps); 0: train.steps steps")
    batch_size: int = opt(64, "jobs.sft: rows per optimizer step, over all trainer workers")
    max_len: int = opt(512, "jobs.sft: longest row in tokens, prompt and completion: a longer one loses its end; one left without a completion token is an error naming it")
    eval_every: int = opt(0, "jobs.sft: held-out loss every N steps; 0: before and after training only")
    accuracy_n: int = opt(128, "jobs.sft, embedded data: greedy accuracy of the model before and after on this many held-out problems; 0: none")
    max_new_tokens: int = opt(96, "jobs.sft: token budget of the greedy accuracy check's answers")

    def check(self) -> None:
        require(self.n_train >= 1, "sft.n_train must be >= 1")
        require(self.n_eval >= 0, "sft.n_eval must be >= 0")
        require(0 <= self.p_direct <= 1, "sft.p_direct must be in [0, 1]")
        require(self.epochs >= 0, "sft.epochs must be >= 0 (0: train.steps steps)")
        require(self.batch_size >= 1, "sft.batch_size must be >= 1")
        require(self.max_len >= 2, "sft.max_len must be >= 2 (a prompt token and a completion token)")
        require(self.eval_every >= 0, "sft.eval_every must be >= 0")
        require(self.accuracy_n >= 0, "sft.accuracy_n must be >= 0")
        require(self.max_new_tokens >= 1, "sft.max_new_tokens must be >= 1")
