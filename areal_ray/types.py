"""Samples and prompt groups: what flows from rollout through reward to the trainer.

A `Sample` is one generated answer: the prompt's token ids, the output's token ids,
the behaviour logprob and policy version of every output token (prompt tokens have
version -1 by convention and are not stored per token), the stop reason, and after
the reward stage its reward and the reason for it. A multi-turn sample's output also
holds the tool outputs appended between turns; its `loss_mask` marks which output
tokens the policy sampled (only those train; tool tokens have logprob 0, version -1). A `Group` is the n samples of one
prompt plus its admission ticket from the staleness gate, which fixes the training
step the group belongs to.

Through Ray Data a group travels as one row `{"ticket": int, "group": json-str}`:
nested variable-length lists do not map cleanly onto Arrow columns, and JSON keeps
the row format obvious to anyone debugging a pipeline.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Sample:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    text: str = ""  # decoded output, what the reward checker grades
    reward: float | None = None
    reward_reason: str = ""
    n_resubmits: int = 0
    # Per output token: 1 for the policy's own tokens, 0 for tokens it did not sample
    # (a tool's output appended between turns; logprob 0 and version -1 there). None:
    # every output token is the policy's (single-turn).
    loss_mask: list[int] | None = None
    n_turns: int = 1
    tool_calls: int = 0

    @property
    def min_version(self) -> int:
        """The version of the oldest policy token (tool tokens carry -1 and no version)."""
        return min((v for v in self.versions if v >= 0), default=-1)

    def staleness(self, trained_version: int) -> int:
        """Versions between this sample's oldest token and the policy it trains."""
        v = self.min_version
        return trained_version - v if v >= 0 else 0


@dataclass
class Group:
    ticket: int
    uid: str
    prompt: str
    answer: str
    verifier: str
    admitted_version: int
    samples: list[Sample] = field(default_factory=list)
    pos: int = -1  # the prompt's position in the run's prompt stream (resume skips consumed ones)
    meta: dict = field(default_factory=dict)

    def to_row(self) -> dict:
        return {"ticket": self.ticket, "group": json.dumps(asdict(self))}

    @staticmethod
    def from_row(row: dict) -> Group:
        d = json.loads(row["group"])
        d["samples"] = [Sample(**s) for s in d["samples"]]
        return Group(**d)
