"""`task.*`: where prompts and reference answers come from (a dataset, or an embedded
task: `arith`, `tool_arith` or `chain_arith`), and how they are read and shuffled (docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.choices import EmbeddedTask
from areal_ray.config.section import opt, require


@dataclass(kw_only=True)
class TaskConfig:
    train_path: str = opt("", "prompt dataset: a .jsonl/.parquet/.arrow file, a directory or a glob (docs/data.md); empty: the embedded task (task.embedded)")
    eval_path: str = opt("", "held-out dataset, same forms as train_path; empty: the embedded task (task.embedded, disjoint seed)")
    embedded: EmbeddedTask = opt(EmbeddedTask.arith, "the embedded task used where train_path or eval_path is empty: arith (chains of small sums; model artifacts/tiny) or tool_arith (3-4 digit sums solved with a calc(...) tool call; model artifacts/tiny-tools, rollout.workflow ToolWorkflow: conf/tools.yaml) or chain_arith (long chains worked step by step, 20 to 400-token answers with a long tail; model artifacts/tiny-chains: conf/longtail.yaml)")
    prompt_template: str = opt("", "str.format template over a row's fields giving the prompt, e.g. 'Q: {question}'; empty: the row's prompt field")
    answer_field: str = opt("answer", "field of a math row that holds the reference answer")
    answer_pattern: str = opt("", "regex searched in answer_field; its first group (else the match) is the answer, e.g. '####\\s*(.+)$' for GSM8K; empty: the whole field")
    n_eval: int = opt(256, "held-out problems evaluated before and after training")
    seed: int = opt(0, "seed of the embedded task's problems and of the per-epoch shuffle")
    shuffle_window: int = opt(10_000, "per-epoch shuffle of a dataset file: rows are permuted within windows of this many consecutive rows, and files among themselves (a smaller dataset is shuffled whole; docs/data.md)")
    max_row_bytes: int = opt(1 << 20, "largest dataset row, in bytes (a jsonl line; a parquet or arrow row's text fields): a larger one is an error naming its file and row, found before the run for jsonl files; 0: no limit")
    max_steps_per_problem: int = opt(8, "longest chain of the embedded arithmetic task (task.embedded=arith)")
    chain_p_stop: float = opt(0.35, "embedded arith task: chains have 1 + Geometric(chain_p_stop) steps (capped at max_steps_per_problem); smaller means a longer tail of output lengths")
    chain_median_steps: float = opt(5.0, "embedded chain_arith task: median number of steps of its log-normal step count")
    chain_sigma: float = opt(1.25, "embedded chain_arith task: spread (log space) of the step count; larger means a longer tail")
    chain_max_steps: int = opt(48, "embedded chain_arith task: longest chain (a worked answer of about 8 tokens a step)")

    def check(self) -> None:
        require(self.shuffle_window >= 1, "task.shuffle_window must be >= 1")
        require(self.max_row_bytes >= 0, "task.max_row_bytes must be >= 0 (0: no limit)")
        require(0 < self.chain_p_stop <= 1, "task.chain_p_stop must be in (0, 1]")
        require(self.chain_median_steps >= 1, "task.chain_median_steps must be >= 1")
        require(self.chain_sigma >= 0, "task.chain_sigma must be >= 0")
        require(self.chain_max_steps >= 1, "task.chain_max_steps must be >= 1")
        require(bool(self.answer_field), "task.answer_field must name the field holding the reference answer")
        require(self.embedded == EmbeddedTask.arith or not (self.train_path and self.eval_path),
                f"task.embedded={self.embedded} is used only where task.train_path or "
                "task.eval_path is empty; both are set, so leave task.embedded at arith")
