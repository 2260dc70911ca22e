"""areal_ray/observe/plots.py: a PNG from step records, and a clear error without any."""

import pytest

from areal_ray.observe.plots import plot_curves


def test_plot_curves_writes_a_png(tmp_path):
    steps = [{"version": v, "reward_mean": 0.1 * v, "staleness_mean": 0.5, "staleness_max": 1,
              "n_tokens": 100, "step_s": 0.5 if v > 1 else None} for v in range(1, 5)]
    out = plot_curves(steps, tmp_path / "sub" / "curves.png", title="t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_no_steps_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no step records"):
        plot_curves([], tmp_path / "x.png")


def test_entropy_and_mismatch_get_a_panel_when_recorded(tmp_path):
    base = {"reward_mean": 0.1, "staleness_mean": 0.5, "staleness_max": 1, "n_tokens": 100,
            "step_s": 0.5}
    plain = plot_curves([dict(base, version=v) for v in range(1, 5)], tmp_path / "a.png")
    steps = [dict(base, version=v, entropy=2.0 - 0.1 * v, mismatch_k3=None if v == 2 else 1e-3)
             for v in range(1, 5)]
    both = plot_curves(steps, tmp_path / "b.png")
    from matplotlib.image import imread
    assert imread(both).shape[0] > imread(plain).shape[0]  # the fourth panel
