"""Roles on node types: which nodes a rollout replica or a trainer worker may run on.

A multi-node cluster mixes node types (inference nodes, training nodes, CPU nodes for
rewards), and Ray places an actor on any node with the resources it asks for. Two Ray
mechanisms pin a role to a type, and each role takes both (`rollout.resources`,
`rollout.node_labels`, `train.resources`, `train.node_labels`):
- custom resources: a node started with `ray start --resources='{"inference": 8}'`
  offers 8 units of "inference"; a replica asking for one can only go there;
- node labels (Ray 2.60's label selectors): a node started with `ray start
  --labels='{"pool": "train"}'` matches a selector `{"pool": "train"}`; values may be
  negated (`"!spot"`) or sets (`"in(a100, h100)"`, `"!in(spot, preemptible)"`), as
  Ray writes them.
`NodeRequirement` is one role's: checked by Ray's own validator, turned into the
options Serve and Ray Train take, and matched against a node by the planner
(cluster/plan.py), which refuses a run no node can host before anything is deployed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Resources with keys of their own (num_cpus, num_gpus, ...) or that Ray sets itself.
RESERVED = {"CPU", "GPU", "memory", "object_store_memory"}
_SET = re.compile(r"^(!?)in\((.*)\)$")


@dataclass(frozen=True)
class NodeRequirement:
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, section) -> NodeRequirement:
        """A config section's (rollout, train) `resources` and `node_labels`."""
        return cls({str(k): _number(v) for k, v in (section.resources or {}).items()},
                   {str(k): str(v) for k, v in (section.node_labels or {}).items()})

    def problem(self, where: str) -> str | None:
        """Why this requirement is not one Ray accepts (None when it is); `where` names
        the config section."""
        for name, amount in self.resources.items():
            if name in RESERVED or name.startswith("node:"):
                return (f"{where}.resources.{name}: {name} is not a custom resource (CPUs and "
                        f"GPUs have keys of their own; node:<ip> is Ray's)")
            if not amount > 0:  # NaN: not a number
                return f"{where}.resources.{name} must be a number > 0"
        if not self.labels:
            return None
        from ray._private.label_utils import validate_label_selector  # Ray's own rules
        why = validate_label_selector(dict(self.labels))
        return f"{where}.node_labels: {why}" if why else None

    def matches(self, resources: dict[str, float], labels: dict[str, str]) -> bool:
        """Whether a node offering `resources` (totals) and carrying `labels` could
        host one actor of this role, resources aside from their amounts left."""
        return all(resources.get(k, 0.0) >= v for k, v in self.resources.items()) and \
            all(selector_matches(v, labels.get(k)) for k, v in self.labels.items())

    def actor_options(self) -> dict:
        """Ray actor options (Serve's `ray_actor_options`) that pin the role."""
        out = {}
        if self.resources:
            out["resources"] = dict(self.resources)
        if self.labels:
            out["label_selector"] = dict(self.labels)
        return out

    def describe(self) -> str:
        parts = [f"{k}={v:g}" for k, v in self.resources.items()]
        parts += [f"label {k}={v}" for k, v in self.labels.items()]
        return ", ".join(parts)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def selector_matches(selector: str, value: str | None) -> bool:
    """One label selector value against a node's label (None: the node lacks it), as
    Ray reads it: `x` equals, `!x` differs (or is absent), `in(a, b)` is one of,
    `!in(a, b)` is none of (or is absent)."""
    negate = selector.startswith("!")
    m = _SET.match(selector)
    if m:
        options = {o.strip() for o in m.group(2).split(",")}
        inside = value is not None and value in options
        return not inside if m.group(1) else inside
    want = selector[1:] if negate else selector
    return value != want if negate else value == want
