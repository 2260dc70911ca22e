"""`reward.judge.*` and `reward.reward_model.*`: rewards from a served model.

Each is its own Ray Serve app, started with the run and owned by it
(cluster/ownership.py): the generative judge (`reward.judge`: an LLM prompted with the
question and the answer, its text parsed to a score) and the scalar reward model
(`reward.reward_model`: a sequence-classification head). A row whose `verifier` is
`judge` or `reward_model` is graded by it, as is a row whose verifier is listed in
`instead_of` (e.g. `[math]`: the embedded task judged by the model; held-out evaluation
still grades those rows by their own checker). Every call has a deadline: a late or
failed call is reward 0 with its reason, counted in the step record's reward_reasons.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from areal_ray.config.choices import Choice
from areal_ray.config.section import opt, require

JUDGE, REWARD_MODEL = "judge", "reward_model"  # the verifier names of the served rewards
# What a template may name (areal_ray/judge/prompt.py fills them).
TEMPLATE_FIELDS = ("question", "response", "answer", "reference")


class JudgeParser(Choice):
    """How the judge's text becomes a reward (areal_ray/judge/parse.py)."""
    score = "score"  # the last number (a \\boxed{} one first) over score_max, clipped to [0, 1]
    verdict = "verdict"  # yes/correct/pass -> 1, no/incorrect/wrong/fail -> 0


class Squash(Choice):
    """How the reward model's scalar becomes the reward."""
    sigmoid = "sigmoid"  # sigmoid(logit): in (0, 1)
    none = "none"  # the raw scalar


def check_template(template: str, key: str) -> None:
    """Fields of `template` are among TEMPLATE_FIELDS, or ConfigError naming `key`."""
    try:
        names = [n for _, n, _, _ in string.Formatter().parse(template) if n is not None]
    except ValueError as e:
        require(False, f"{key}: {e} (a literal brace is written {{{{ or }}}})")
    bad = [n for n in names if n not in TEMPLATE_FIELDS]
    require(not bad, f"{key}: unknown field(s) {bad}; a template may name "
                     f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}")
    require(bool(names), f"{key}: the template names no field, so every sample would get "
                         f"the same prompt; name one of {TEMPLATE_FIELDS}")


@dataclass(kw_only=True)
class ServedRewardConfig:
    """What both served rewards share: the model, the Serve app and the deadline."""
    enabled: bool = opt(False, "start this served reward with the run; rows naming it are graded by it")
    instead_of: list = opt([], "row verifiers graded by this model in training instead of their checker (e.g. [math]); held-out evaluation keeps their checker")
    min_replicas: int = opt(1, "fewest replicas (Serve autoscaling)")
    max_replicas: int = opt(1, "most replicas; more than min_replicas: Serve autoscales on ongoing requests")
    target_ongoing_requests: int = opt(16, "autoscaling target of ongoing requests per replica")
    max_ongoing_requests: int = opt(64, "requests a replica takes at once (the batcher's queue)")
    upscale_delay_s: float = opt(2.0, "autoscaling: how long demand must stay high before a replica is added")
    downscale_delay_s: float = opt(30.0, "autoscaling: how long demand must stay low before a replica goes")
    num_cpus: float = opt(0.25, "CPUs reserved per replica")
    num_gpus: float = opt(0.0, "GPUs per replica (a fraction shares one)")
    torch_threads: int = opt(1, "torch threads per replica")
    dtype: str = opt("float32", "the model's dtype on the replica")
    max_batch_size: int = opt(32, "serve.batch: most calls answered by one batched forward")
    batch_wait_timeout_s: float = opt(0.01, "serve.batch: how long a batch waits to fill")
    timeout_s: float = opt(10.0, "per-call deadline, from the call's send; a call past it is reward 0 (reason '<verifier> timeout')")
    retries: int = opt(1, "a failed call (a replica died) is sent again this many times while its deadline leaves time")

    def check_served(self, key: str) -> None:
        require(1 <= self.min_replicas <= self.max_replicas,
                f"need 1 <= {key}.min_replicas <= {key}.max_replicas")
        require(self.target_ongoing_requests >= 1, f"{key}.target_ongoing_requests must be >= 1")
        require(self.max_ongoing_requests >= 1, f"{key}.max_ongoing_requests must be >= 1")
        require(self.num_cpus >= 0 and self.num_gpus >= 0, f"{key}.num_cpus and num_gpus must be >= 0")
        require(self.torch_threads >= 1, f"{key}.torch_threads must be >= 1")
        require(self.max_batch_size >= 1, f"{key}.max_batch_size must be >= 1")
        require(self.batch_wait_timeout_s >= 0, f"{key}.batch_wait_timeout_s must be >= 0")
        require(self.timeout_s > 0, f"{key}.timeout_s must be > 0 (the per-call deadline)")
        require(self.retries >= 0, f"{key}.retries must be >= 0")
        for name in self.instead_of:
            require(isinstance(name, str) and bool(name.strip()),
                    f"{key}.instead_of: {name!r} is not a verifier name")
            require(name not in (JUDGE, REWARD_MODEL),
                    f"{key}.instead_of: {name!r} is a served reward itself")


@dataclass(kw_only=True)
class JudgeConfig(ServedRewardConfig):
    model: str = opt("artifacts/tiny-judge", "the judge: an HF causal LM dir (artifacts/tiny-judge: the embedded one, built on first use)")
    template: str = opt("{reference:>3}:{answer:>3}?", "the judge's prompt, a str.format template (format specs allowed) over {question}, {response} (the sample's text), {answer} (its last \\boxed{} answer) and {reference} (the row's answer)")
    max_new_tokens: int = opt(8, "the judge's generation budget (greedy)")
    parser: JudgeParser = opt(JudgeParser.score, "how the judge's text becomes a reward: score (last number / score_max) or verdict (yes/no words)")
    score_max: float = opt(1.0, "parser=score: the judge's top score (the reward is score / score_max, clipped to [0, 1])")

    def check(self) -> None:
        self.check_served("reward.judge")
        check_template(self.template, "reward.judge.template")
        require(self.max_new_tokens >= 1, "reward.judge.max_new_tokens must be >= 1")
        require(self.score_max > 0, "reward.judge.score_max must be > 0")


@dataclass(kw_only=True)
class RewardModelConfig(ServedRewardConfig):
    model: str = opt("artifacts/tiny-rm", "the reward model: an HF sequence-classification dir with one label (artifacts/tiny-rm: the embedded one, built on first use)")
    template: str = opt("{reference:>3}:{answer:>3}", "the text scored, a str.format template over {question}, {response}, {answer} and {reference} (as reward.judge.template)")
    squash: Squash = opt(Squash.sigmoid, "how the scalar becomes the reward: sigmoid (in (0, 1)) or none (raw)")
    max_len: int = opt(512, "longest scored text, in tokens (its start is cut)")

    def check(self) -> None:
        self.check_served("reward.reward_model")
        check_template(self.template, "reward.reward_model.template")
        require(self.max_len >= 1, "reward.reward_model.max_len must be >= 1")


def served_verifiers(judge: JudgeConfig, reward_model: RewardModelConfig) -> tuple[str, ...]:
    """The served verifier names a row may give: those enabled."""
    return tuple(n for n, c in ((JUDGE, judge), (REWARD_MODEL, reward_model)) if c.enabled)


def served_route(judge: JudgeConfig, reward_model: RewardModelConfig) -> dict[str, str]:
    """Row verifier -> the served reward that grades it in training (enabled ones only)."""
    route = {}
    for name, c in ((JUDGE, judge), (REWARD_MODEL, reward_model)):
        if c.enabled:
            route[name] = name
            route.update({v: name for v in c.instead_of})
    return route
