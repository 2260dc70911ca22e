"""Fail fast when the driver actor dies: the Ray Train run stops instead of retrying.

The driver holds what a run cannot rebuild from a checkpoint alone while it runs (the
gate, tickets in flight, publications), so a run cannot go on without it. Ray Train
would treat the trainer's resulting errors as worker failures and restart the worker
group (`train.max_failures`), which cannot work either. This callback runs in Ray
Train's controller: a thread there checks the driver every `period_s` and, once it is
gone, kills the controller, whose worker group and data pipeline go with it (Ray ends
the actors an actor owns). The job then reports the driver's death and how to resume
(`areal_ray/run/job.py`). A thread, not the controller's event loop: that loop blocks in
calls like starting a worker group, which is where a retry without a driver hangs.
"""

from __future__ import annotations

import threading

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.util.placement_group import remove_placement_group


def actor_alive(handle, timeout_s: float) -> bool:
    """False only for an actor that is gone: one too busy to answer counts as alive."""
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return True
    except ray.exceptions.RayActorError:
        return False
    return True


class DriverWatch(ControllerCallback, WorkerGroupCallback):
    def __init__(self, driver_name: str, namespace: str, period_s: float = 2.0):
        self.driver_name, self.namespace, self.period_s = driver_name, namespace, period_s
        self._placement_group = None

    def after_worker_group_start(self, worker_group) -> None:
        # Killing the controller does not free its worker group's placement group:
        # Ray Train's own cleaner asks the state API whether the controller lives, which
        # needs the dashboard (off in our local clusters), and its CPUs stayed reserved
        # for good (a later run's reward actor could not be placed). We free it.
        self._placement_group = worker_group.get_worker_group_state().placement_group_handle.placement_group

    def after_controller_start(self, train_run_context) -> None:
        self._driver = ray.get_actor(self.driver_name, namespace=self.namespace)
        self._controller = ray.get_runtime_context().current_actor
        threading.Thread(target=self._watch, daemon=True, name="areal-driver-watch").start()

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        # A worker group that failed because the driver died is about to be restarted
        # (a new placement group) unless the run stops here, before that.
        if not self._driver_alive():
            self._stop_run()

    def _driver_alive(self) -> bool:
        return actor_alive(self._driver, timeout_s=30)

    def _stop_run(self) -> None:
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)  # ends the workers in it
        ray.kill(self._controller, no_restart=True)

    def _watch(self) -> None:
        stop = threading.Event()
        while not stop.wait(self.period_s):
            if not self._driver_alive():
                self._stop_run()
                return
