"""What the collective sender publishes when the broadcast cannot carry a push (no
replica in the group, or a failed broadcast): the object-store copy is in
`weights.dtype`, as the broadcast would have been, while the weights the push returns
(for checkpoints) stay in the trained dtype. The driver and the group are stand-ins."""

import pytest
import torch

from areal_ray.config import WeightsConfig
from areal_ray.weights import senders as weight_senders
from areal_ray.weights.senders import CollectiveSender, SenderContext


class Driver:
    """The driver actor's push calls, answered at once (`.remote` returns the reply,
    and the test's `ray.get` hands it back)."""

    def __init__(self, plan):
        self.plan, self.published = plan, []
        reply = {"load_s": 0.0, "replicas": 1, "dropped": []}
        self.begin_push = self._call(lambda version, specs, bucket, adapter=None: self.plan)
        self.push_weights = self._call(lambda version, payload: self._got(payload, reply))
        self.fallback_push = self._call(lambda version, payload: self._got(payload, reply))
        self.set_weight_store = self._call(lambda host, port: None)

    def _got(self, payload, reply):
        self.published.append(payload)
        return reply

    @staticmethod
    def _call(fn):
        return type("Method", (), {"remote": staticmethod(fn)})()


class DeadGroup:
    """A group whose broadcast fails the way a dead member makes it fail."""

    def __init__(self, *args):
        self.epoch = args[1]

    @staticmethod
    def serve(host, timeout_s):
        return object(), 0

    def send(self, tensors, specs, bucket_bytes):
        next(iter(tensors))  # the first bucket was being filled
        raise RuntimeError("weight group epoch 1 send failed: connection reset")


@pytest.fixture
def sender(monkeypatch):
    monkeypatch.setattr(weight_senders.ray, "get", lambda reply: reply)
    monkeypatch.setattr(weight_senders, "WeightGroup", DeadGroup)
    monkeypatch.setattr(weight_senders, "put_state", lambda state: state)  # the staged dict

    def build(dtype, plan):
        driver = Driver(plan)
        cfg = WeightsConfig(path="collective", dtype=dtype, bucket_mb=1)
        return CollectiveSender(SenderContext(cfg, driver, 1, None)), driver
    return build


@pytest.mark.parametrize("plan", [None, {"epoch": 1, "world": 2, "serial": 0}],
                         ids=["no replica in the group", "failed broadcast"])
@pytest.mark.parametrize("dtype,published", [
    ("", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_the_object_store_copy_of_a_collective_push_is_in_the_transfer_dtype(sender, plan, dtype,
                                                                             published):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    s, driver = sender(dtype, plan)
    weights, stats = s.push(model, 1, 0.0)
    [state] = driver.published
    assert {v.dtype for v in state.values()} == {published}
    assert state.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v.to(published))
    assert {v.dtype for v in weights.values()} == {torch.float32}  # checkpoints: trained dtype
    assert stats["push_bytes"] == sum(v.numel() * published.itemsize for v in state.values())
    assert stats["push_path"] == ("object_store" if plan is None else "object_store (fallback)")
