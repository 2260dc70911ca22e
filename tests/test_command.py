"""The `areal-ray` command (jobs/__main__.py, installed by pyproject.toml): every
subcommand names an importable entry point with a `main`, and `--help` is the job's own."""

import importlib
import tomllib
from pathlib import Path

import pytest

from jobs.__main__ import COMMANDS, bench_names, main, resolve

REPO = Path(__file__).resolve().parent.parent


def test_pyproject_installs_the_command_and_the_packages_it_dispatches_to():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["areal-ray"] == "jobs.__main__:main"
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for module in [m for m, _ in COMMANDS.values()] + ["benchmarks.bench_async", "areal_ray.run.job"]:
        assert f"{module.split('.')[0]}*" in include, module


@pytest.mark.parametrize("argv", [[c] for c in COMMANDS] + [["bench", b] for b in bench_names()])
def test_each_subcommand_is_an_entry_point_with_a_main(argv):
    module, rest = resolve(argv + ["x=1"])
    assert rest == ["x=1"]
    assert callable(importlib.import_module(module).main)


def test_the_bench_names_are_the_bench_files():
    files = {p.stem.removeprefix("bench_") for p in (REPO / "benchmarks").glob("bench_*.py")}
    assert set(bench_names()) == files and {"async", "peers", "repro"} <= files
    assert resolve(["bench", "async", "steps=2"]) == ("benchmarks.bench_async", ["steps=2"])


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {c} " in out for c in COMMANDS) and "  bench " in out
    assert all(b in out for b in bench_names())


@pytest.mark.parametrize("argv", [[], ["nope"], ["bench"], ["bench", "nope"]])
def test_an_unknown_or_missing_command_is_exit_status_2(argv, capsys):
    assert main(argv) == 2
    assert "usage: areal-ray" in capsys.readouterr().err


def test_a_subcommands_help_is_the_jobs_own(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's --help (jobs/cli.py)
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "python -m jobs.train" in out and "algo.eta" in out
    with pytest.raises(SystemExit) as e:
        main(["bench", "async", "--help"])
    assert e.value.code == 0 and "python -m benchmarks.bench_async" in capsys.readouterr().out
    assert main(["gpu-prereqs", "--help"]) == 0  # standard library only: its docstring
    assert "engine=sglang|vllm" in capsys.readouterr().out
    assert main(["make-tiny", "--help"]) == 0
    assert "hidden_size = 128" in capsys.readouterr().out
