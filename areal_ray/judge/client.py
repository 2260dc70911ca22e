"""The reward stage's side of the served rewards: a group's samples sent at once (the
replica's `serve.batch` batches them, with other groups'), each answer awaited until
its call's deadline (deadline.py). The reward actor only sends and waits: no model, no
checker process, and a slow or dead judge costs a group at most its deadline.
"""

from __future__ import annotations

import time

from areal_ray.judge.deadline import CallDeadline, answered, failed, late
from areal_ray.judge.prompt import Item

DEPLOYMENTS = {"judge": "Judge", "reward_model": "RewardModel"}


class ServedRewards:
    """Grades the samples of rows routed to a served reward (`route`: row verifier ->
    served kind, config/judge.py `served_route`), through the apps named by `apps`
    (kind -> Serve app name). `limits`: kind -> (timeout_s, retries)."""

    def __init__(self, route: dict[str, str], apps: dict[str, str],
                 limits: dict[str, tuple[float, int]]):
        self.route, self.apps, self.limits = dict(route), dict(apps), dict(limits)
        self._handles: dict[str, object] = {}
        self.calls = {"sent": 0, "late": 0, "failed": 0, "retried": 0}

    def serves(self, verifier: str) -> bool:
        return verifier in self.route

    def _handle(self, kind: str):
        if kind not in self._handles:
            from ray import serve
            self._handles[kind] = serve.get_deployment_handle(DEPLOYMENTS[kind], self.apps[kind])
        return self._handles[kind]

    def grade(self, verifier: str, question: str, reference: str,
              texts: list[str]) -> list[tuple[float, str]]:
        """(reward, reason) of each text, in order; never raises for a call's failure."""
        kind = self.route[verifier]
        timeout_s, retries = self.limits[kind]
        items = [Item(question, t, reference) for t in texts]
        now = time.monotonic()
        calls = [(self._send(kind, it), CallDeadline(timeout_s, retries, now)) for it in items]
        self.calls["sent"] += len(calls)
        return [self._await(kind, it, sent, dl) for it, (sent, dl) in zip(items, calls)]

    def _send(self, kind: str, item: Item):
        """The call's response, or the error that kept it from being sent (the app is
        gone: the handle or the send raises)."""
        try:
            return self._handle(kind).grade.remote(item)
        except Exception as e:  # noqa: BLE001 - judged by the deadline policy, as a failed call
            self._handles.pop(kind, None)
            return e

    def _await(self, kind: str, item: Item, sent, dl: CallDeadline) -> tuple[float, str]:
        while True:
            try:
                if isinstance(sent, Exception):
                    raise sent
                return answered(kind, sent.result(timeout_s=max(dl.left(time.monotonic()), 1e-3)))
            except TimeoutError:
                sent.cancel()
                self.calls["late"] += 1
                return late(kind, dl.timeout_s)
            except Exception as e:  # noqa: BLE001 - a dead replica, a lost app: reward 0, said why
                if not dl.retry(time.monotonic()):
                    self.calls["failed"] += 1
                    return failed(kind, e, dl.attempts)
                self.calls["retried"] += 1
                sent = self._send(kind, item)


def from_config(reward, owner_tag: str) -> ServedRewards | None:
    """The run's served rewards (`reward.judge`, `reward.reward_model`), their apps named
    from the job's tag (cluster/ownership.py); None when neither is enabled."""
    from areal_ray.cluster.ownership import Owned
    from areal_ray.config.judge import served_route
    route = served_route(reward.judge, reward.reward_model)
    if not route:
        return None
    owned = Owned(owner_tag)
    kinds = set(route.values())
    sections = {"judge": reward.judge, "reward_model": reward.reward_model}
    return ServedRewards(route, {k: owned.served_app_name(k) for k in kinds},
                         {k: (sections[k].timeout_s, sections[k].retries) for k in kinds})
