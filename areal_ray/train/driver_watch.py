"""Fail fast when the driver actor dies: the Ray Train run stops instead of retrying.

The driver holds what a run cannot rebuild from a checkpoint alone while it runs (the
gate, tickets in flight, publications), so a run cannot go on without it. Ray Train
would treat the trainer's resulting errors as worker failures and restart the worker
group (`train.max_failures`), which cannot work either. This callback runs in Ray
Train's controller: a thread there checks the driver every `period_s` and, once it is
gone, kills the controller, whose worker group and data pipeline go with it (Ray ends
the actors an actor owns). The job then reports the driver's death and how to resume
(`areal_ray/run.py`). A thread, not the controller's event loop: that loop blocks in
calls like starting a worker group, which is where a retry without a driver hangs.
"""

from __future__ import annotations

import threading

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback


class DriverWatch(ControllerCallback):
    def __init__(self, driver_name: str, namespace: str, period_s: float = 2.0):
        self.driver_name, self.namespace, self.period_s = driver_name, namespace, period_s

    def after_controller_start(self, train_run_context) -> None:
        driver = ray.get_actor(self.driver_name, namespace=self.namespace)
        controller = ray.get_runtime_context().current_actor
        threading.Thread(target=self._watch, args=(driver, controller), daemon=True,
                         name="areal-driver-watch").start()

    def _watch(self, driver, controller) -> None:
        stop = threading.Event()
        while not stop.wait(self.period_s):
            try:
                ray.get(driver.__ray_ready__.remote(), timeout=30)
            except ray.exceptions.GetTimeoutError:
                continue  # busy, not gone
            except ray.exceptions.RayActorError:
                ray.kill(controller, no_restart=True)
                return
