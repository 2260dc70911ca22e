"""The teacher app's part in a run (areal_ray/run/job.py): its model resolved (the
embedded teacher built on first use) and checked before Ray starts, deployed beside
the rollout app, running before any prompt is admitted; deleted with the run's other owned apps
(cluster/placement.py `delete_extra_apps`)."""

from __future__ import annotations

from areal_ray.distill.stage import teacher_app_name
from areal_ray.distill.teacher_model import check_same_tokenizer, resolve_teacher


def prepare(cfg, model_path: str) -> str:
    """The teacher's model dir ("" without distillation), checked against the student's."""
    if not cfg.algo.distill.enabled:
        return ""
    path = resolve_teacher(cfg.algo.distill.teacher_path)
    check_same_tokenizer(model_path, path)
    return path


def start(cfg, teacher_path: str, app_name: str) -> None:
    """Deploy the teacher app without waiting (`wait` waits)."""
    if not teacher_path:
        return
    from areal_ray.cluster.placement import deploy_app
    from deployments.teacher import build_teacher_app
    deploy_app(build_teacher_app(cfg, teacher_path), teacher_app_name(app_name),
               cfg.run.placement_timeout_s, wait=False)


def wait(cfg, app_name: str) -> None:
    if cfg.algo.distill.enabled:
        from areal_ray.cluster.placement import wait_for_app
        wait_for_app(teacher_app_name(app_name), cfg.run.placement_timeout_s)


def may_drop(cfg) -> bool:
    """Whether the teacher stage drops groups (then the run needs more prompts)."""
    return cfg.algo.distill.enabled and cfg.algo.distill.late == "drop"
