"""Per-token distillation advantages and the teacher's verdict on a group (pure).

The teacher scores each sample's completion under the same prompt: log p_T(y_t | x,
y_<t). The student's behaviour logprob log p_S(y_t | ...) came with the sample, so
the advantage of token t is

    A_t = coef * (log p_T(y_t) - log p_S(y_t)) + reward_weight * A_task

where A_task is the sample's advantage from the task reward (the run's estimator).
Summed over a sequence the first term is minus the sampled estimate of the reverse
KL(p_S || p_T): the policy gradient pushes the student towards the tokens the teacher
finds likelier than it does. Tokens the policy did not sample (a tool's output) get 0
and are out of the loss anyway.

A group's teacher call ends in one of three states, written into `group.meta[TEACHER]`
by the scoring stage: OK (per-sample logprobs), LATE (past `algo.distill.deadline_s`)
or FAILED (the call raised, or its answer did not fit the samples). A LATE or FAILED
group is dropped (`late=drop`: delivered without samples, replaced like a filtered
group) or trains on its task advantage alone (`late=reward`, at weight 1, whatever
`reward_weight` is: the teacher's part is missing, not the group's signal).
"""

from __future__ import annotations

import math

from areal_ray.types import Group

TEACHER = "teacher"  # the group.meta key
OK, LATE, FAILED = "ok", "late", "failed"


def token_advantages(teacher: list[float], behaviour: list[float], task_adv: float,
                     coef: float = 1.0, reward_weight: float = 0.0,
                     loss_mask: list[int] | None = None) -> list[float]:
    """A_t for each output token (0 where `loss_mask` is 0)."""
    if len(teacher) != len(behaviour):
        raise ValueError(f"teacher scored {len(teacher)} tokens, the sample has {len(behaviour)}")
    if loss_mask is not None and len(loss_mask) != len(behaviour):
        raise ValueError(f"loss_mask has {len(loss_mask)} entries, the sample {len(behaviour)} tokens")
    mix = reward_weight * task_adv
    return [coef * (t - b) + mix if loss_mask is None or loss_mask[i] else 0.0
            for i, (t, b) in enumerate(zip(teacher, behaviour))]


def check_scores(group: Group, scores: object) -> str | None:
    """Why the teacher's answer does not fit `group` (one finite logprob per output
    token of each sample), or None when it does."""
    if not isinstance(scores, list) or len(scores) != len(group.samples):
        n = len(scores) if isinstance(scores, list) else type(scores).__name__
        return f"the teacher returned {n} scored samples for a group of {len(group.samples)}"
    for i, (s, lp) in enumerate(zip(group.samples, scores)):
        if len(lp) != len(s.output_ids):
            return f"sample {i}: {len(lp)} teacher logprobs for {len(s.output_ids)} output tokens"
        if not math.isfinite(sum(lp)):
            return f"sample {i}: a teacher logprob is not finite"
    return None


def verdict(group: Group) -> dict:
    """The group's teacher record ({} when the stage never saw it)."""
    return group.meta.get(TEACHER, {})


def mark(group: Group, status: str, seconds: float, why: str = "",
         logprobs: list[list[float]] | None = None, drop: bool = False) -> Group:
    """Write the teacher's outcome into `group`; with `drop` (a LATE or FAILED group
    under late=drop) its samples go, so the trainer drops it as a rejected row."""
    group.meta[TEACHER] = {"status": status, "s": seconds, "why": why,
                           "logprobs": logprobs if status == OK else None}
    if drop and status != OK:
        group.meta[TEACHER]["dropped"] = True
        group.samples = []
    return group


def dropped(group: Group) -> bool:
    """A group the teacher stage emptied (late=drop), counted apart from other rejections."""
    return bool(verdict(group).get("dropped"))


def apply(groups: list[Group], seqs: list[dict], coef: float, reward_weight: float) -> None:
    """Give every sequence of a teacher-scored group its per-token advantages
    (`seq["token_advantages"]`, which the trainer writes instead of the scalar
    `seq["advantage"]`); sequences of late groups keep their task advantage."""
    by_ticket = {g.ticket: g for g in groups}
    for seq in seqs:
        v = verdict(by_ticket[seq["ticket"]])
        if v.get("status") != OK:
            continue
        seq["token_advantages"] = token_advantages(
            v["logprobs"][seq["sample"]], seq["logprobs"], seq["advantage"], coef, reward_weight,
            seq.get("loss_mask"))


def metrics(groups: list[Group], teacher_dropped: int = 0) -> dict:
    """The step record's teacher numbers: groups scored, trained on the reward alone
    (late), dropped; the call time; and over the policy's tokens of scored groups the
    mean of log p_S - log p_T (the sampled reverse KL per token) and of log p_T."""
    ok = [g for g in groups if verdict(g).get("status") == OK]
    late = [g for g in groups if verdict(g).get("status") in (LATE, FAILED)]
    diffs, teach = [], []
    for g in ok:
        for s, lp in zip(g.samples, verdict(g)["logprobs"]):
            mask = s.loss_mask or [1] * len(lp)
            for t, b, m in zip(lp, s.logprobs, mask):
                if m:
                    diffs.append(b - t)
                    teach.append(t)
    secs = [verdict(g)["s"] for g in ok + late]
    return {"teacher_scored": len(ok), "teacher_late": len(late), "teacher_dropped": teacher_dropped,
            "teacher_s_mean": sum(secs) / len(secs) if secs else None,
            "teacher_s_max": max(secs, default=None),
            "distill_reverse_kl": sum(diffs) / len(diffs) if diffs else None,
            "teacher_logprob_mean": sum(teach) / len(teach) if teach else None}
