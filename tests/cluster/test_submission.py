"""What `ray job submit --working-dir .` needs of the repository: large local copies are
.gitignore'd (Ray skips those and refuses uploads over 512 MiB), so GPU configs name
their model and data by absolute paths, and a relative one that is missing says why."""

import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from areal_ray.config import load_config

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIGS = sorted(p.name for p in (REPO / "conf").glob("*.yaml")
                     if OmegaConf.select(OmegaConf.load(p), "train.use_gpu", default=False))


def ignored(path: str) -> bool:
    """By .gitignore's patterns alone, tracked or not."""
    out = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", path])
    assert out.returncode in (0, 1), out
    return out.returncode == 0


def test_the_gpu_configs_are_found():
    assert {"gsm8k_qwen_sglang.yaml", "gsm8k_qwen_vllm.yaml", "code_qwen_sglang.yaml"} <= set(GPU_CONFIGS)


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_name_absolute_model_and_data_paths(name):
    cfg = load_config(str(REPO / "conf" / name))
    paths = {"model.path": cfg.model.path, "task.train_path": cfg.task.train_path,
             "task.eval_path": cfg.task.eval_path}
    if cfg.eval.model_path:
        paths["eval.model_path"] = cfg.eval.model_path
    for key, value in paths.items():
        assert value and Path(value).is_absolute(), (key, value)


@pytest.mark.parametrize("path", [".venv-gpu/bin/python", "models/Qwen2.5-1.5B-Instruct/config.json",
                                  "data/gsm8k/main/train-00000-of-00001.parquet", "runs/x", "mlruns/0"])
def test_large_local_copies_are_gitignored(path):
    assert ignored(path)


@pytest.mark.parametrize("path", ["conf/models/qwen2.5-1.5b.json", "data/code_tasks.jsonl"])
def test_shipped_files_are_not(path):
    assert not ignored(path)


def test_a_missing_relative_model_path_says_to_use_an_absolute_one(tmp_path, monkeypatch):
    import areal_ray.run.job as run
    monkeypatch.setattr(run, "REPO_ROOT", tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        run.resolve_model("models/Qwen2.5-1.5B-Instruct")
    msg = str(e.value)
    assert msg.startswith("model.path 'models/Qwen2.5-1.5B-Instruct' does not exist")
    assert f"working directory ({tmp_path}; inside `ray job submit`, Ray's copy of --working-dir" in msg
    assert msg.endswith("use an absolute path")


def test_an_absolute_path_without_a_model_keeps_its_message(tmp_path):
    from areal_ray.run.job import resolve_model
    with pytest.raises(FileNotFoundError, match="has no config.json: not an HF model directory"):
        resolve_model(str(tmp_path))
