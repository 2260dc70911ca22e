"""Which warm start builds which embedded model, without building one."""

import pytest

from areal_ray.task import tiny_model


@pytest.mark.parametrize("path,task", [("artifacts/tiny", "arith"),
                                       ("artifacts/tiny-tools", "tool_arith")])
def test_resolve_model_builds_each_embedded_model_with_its_spec(tmp_path, monkeypatch, path, task):
    import areal_ray.run.job as run

    built = []

    def fake_build(out, spec, log=print):
        built.append(spec)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_model, "build_tiny", fake_build)
    monkeypatch.setattr(run, "REPO_ROOT", tmp_path)  # no committed model to find
    monkeypatch.chdir(tmp_path)
    assert run.resolve_model(path) == str((tmp_path / path).resolve())
    assert [s.task for s in built] == [task]
    assert type(built[0]) is tiny_model.SPECS[task]
    with pytest.raises(FileNotFoundError, match="model.path 'artifacts/other'"):
        run.resolve_model("artifacts/other")


def test_the_tool_spec_differs_only_in_its_warm_start():
    arith, tools = tiny_model.TinyModelSpec(), tiny_model.ToolModelSpec()
    assert (tools.hidden_size, tools.num_hidden_layers) == (arith.hidden_size, arith.num_hidden_layers)
    assert tools.task == "tool_arith" and 0 < tools.sft_p_direct < 1
    with pytest.raises(ValueError, match="task 'chess'"):
        tiny_model.sft(None, None, tiny_model.TinyModelSpec(task="chess"))
