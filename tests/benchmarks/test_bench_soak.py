"""The soak benchmark's fit: growth per 100 steps by process role, start-up left out."""

import pytest

from benchmarks.bench_soak import growth, slope


def test_slope_of_a_line_and_too_few_points():
    assert slope([(0, 1.0), (10, 3.0), (20, 5.0)]) == pytest.approx(0.2)
    assert slope([(0, 1.0), (10, 3.0)]) is None


def test_growth_leaves_out_the_warmup_and_names_the_growing_role():
    mib = 2**20
    samples = [{"step": s, "pss": {"ray::Driver": (100 + (50 if s < 100 else 0) + 0.02 * s) * mib,
                                   "job": 200 * mib}}
               for s in range(0, 600, 20)]
    g = growth(samples, warmup=100)
    assert g["ray::Driver"]["mib_per_100_steps"] == pytest.approx(2.0)
    assert g["job"]["mib_per_100_steps"] == pytest.approx(0.0, abs=1e-9)
    assert g["total"]["mib_per_100_steps"] == pytest.approx(2.0)


def test_growth_leaves_out_the_tear_down_at_the_end():
    # the pipeline's actors exit a few steps before the last step record: a drop that
    # is not negative growth
    mib = 2**20
    samples = [{"step": s, "pss": {"ray::MapWorker": (300 if s < 290 else 100) * mib}}
               for s in range(0, 300, 2)]
    assert growth(samples, warmup=60, last=280)["total"]["mib_per_100_steps"] == pytest.approx(0.0)
    assert growth(samples, warmup=60)["total"]["mib_per_100_steps"] < -10


class _Proc:
    def __init__(self, *cmd):
        self.cmd = list(cmd)

    def cmdline(self):
        return self.cmd

    def name(self):
        return "python"


def test_roles_name_each_ray_data_stage():
    from benchmarks.bench_soak import role
    assert role(_Proc("ray::MapWorker(MapBatches(RolloutStage)).submit()")) == "ray::MapWorker:RolloutStage"
    assert role(_Proc("ray::MapWorker(MapBatches(RewardStage))")) == "ray::MapWorker:RewardStage"
    assert role(_Proc("ray::SplitCoordinator.get()")) == "ray::SplitCoordinator"
    assert role(_Proc("/x/python", "-m", "jobs.train")) == "job"
