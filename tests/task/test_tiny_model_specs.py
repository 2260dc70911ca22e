"""Which warm start builds which embedded model, without building one."""

import pytest

from areal_ray.task import tiny_model


@pytest.mark.parametrize("path,task", [("artifacts/tiny", "arith"),
                                       ("artifacts/tiny-tools", "tool_arith"),
                                       ("artifacts/tiny-agents", "tool_arith_hermes"),
                                       ("artifacts/tiny-chains", "chain_arith"),
                                       ("artifacts/tiny-bpe", "arith_bpe"),
                                       ("artifacts/tiny-bpe-agents", "tool_arith_bpe_hermes")])
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


def test_the_agent_spec_is_the_tool_task_in_hermes_format_from_the_tool_model():
    spec = tiny_model.AgentModelSpec()
    assert (spec.tokenizer, spec.call_format, spec.init_from) == ("hermes", "hermes", "artifacts/tiny-tools")
    assert tiny_model.WARM_STARTS[spec.task] is tiny_model.ToolWarmStart
    assert tiny_model.ToolModelSpec().call_format == "calc"
    with pytest.raises(ValueError, match="call_format 'json'"):
        tiny_model.ToolWarmStart(tiny_model.ToolModelSpec(call_format="json"))


def test_the_chain_spec_starts_from_the_quickstart_model_with_room_for_the_tail():
    spec = tiny_model.ChainModelSpec()
    assert spec.task == "chain_arith" and spec.init_from == "artifacts/tiny"
    assert spec.habit_max_steps > 0 and spec.sft_p_direct == 0  # phase 2 only: quitting early
    longest = 2 + 2 * spec.max_steps_per_problem + 1 + spec.eval_max_new_tokens
    assert spec.max_position_embeddings >= longest


def test_chain_batches_are_length_sorted_runs_of_the_task_distribution():
    import random

    spec = tiny_model.ChainModelSpec(sft_batch_size=16, length_pool=4)
    task = tiny_model.WARM_STARTS["chain_arith"](spec)
    rng = random.Random(0)
    batches = [task.batch(rng, 0.0) for _ in range(200)]
    assert all(len(b) == 16 for b in batches)
    widths = [[len(p.prompt) + len(p.solution) for p in b] for b in batches]
    assert all(w == sorted(w) for w in widths)
    # each problem is equally likely to be drawn: the mean step count is the task's
    drawn = [p.n_steps for b in batches for p in b]
    from areal_ray.task import chains
    ref = [p.n_steps for p in chains.make_split(1, len(drawn))]
    assert abs(sum(drawn) / len(drawn) - sum(ref) / len(ref)) < 0.1 * sum(ref) / len(ref)
    # padding: the spread within a batch is a fraction of the spread across batches
    assert sum(max(w) - min(w) for w in widths) / len(widths) < 0.5 * (max(map(max, widths)) - 1)


def test_init_from_must_name_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="init_from"):
        tiny_model._init_weights(str(tmp_path / "nowhere"))
