"""The multi-turn tool workflow: generate, run the tool the model called, append its
result, generate again, up to a turn and a token budget.

Token ids flow end to end: each turn's request is the prompt ids + every output id so
far (the model's own sampled ids, and the tool results' ids as encoded once), so no
history is ever decoded and re-encoded: what the trainer scores is exactly what the
engine saw. Decoding happens only to *read* a turn (is there a call?) and for the
reward. Per output token the trajectory keeps a loss-mask bit (1: the policy sampled
it; 0: a tool wrote it), the behaviour logprob and the policy version (0.0 and -1 for
tool tokens). A weight push that aborts a turn is a resubmission inside that turn
(interruptible.py): earlier turns keep their versions, the rest of the turn gets the
new one, and the sample's staleness counts its oldest policy token (`Sample`).

Turns of all the group's samples advance together: one Serve call per round carries
every sample that is generating (`generate_rounds`), and the tools of the samples
that stopped at a call run concurrently between rounds, each in a thread of its own
for at most `tool_timeout_s` (tools.py `ToolRunner`): whatever the model's arguments
make a tool do (raise, block, overrun), the sample gets an "error: ..." result and
the episode, and every other episode on this event loop, goes on.

`rollout.max_new_tokens` is the budget of one turn; `max_total_tokens` caps the whole
output (model and tool tokens) so the trainer's sequence length stays bounded.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from areal_ray.plugins import PluginError
from areal_ray.rollout.interruptible import PartialSample, generate_rounds
from areal_ray.rollout.workflows.base import EpisodeConfig, group_of
from areal_ray.rollout.workflows.tools import ToolCall, ToolRunner, build_tools, find_call
from areal_ray.types import Group, Sample

if TYPE_CHECKING:
    from areal_ray.rollout.engine_client import EngineClient


class ToolEpisode:
    """One sample across its turns: the output so far with its mask, logprobs and
    versions, and what it waits for next (a generation round, a tool, or nothing)."""

    def __init__(self, prompt_ids: list[int], turn_tokens: int, total_tokens: int,
                 max_turns: int, seed: Callable[[int], int] | None = None):
        """`seed(call)`: the sampling seed of this sample's engine call number `call`,
        counted over all its rounds and resubmissions (None: unseeded)."""
        self.prompt_ids = list(prompt_ids)
        self.seed, self.calls = seed, 0
        self.turn_tokens, self.total_tokens, self.max_turns = turn_tokens, total_tokens, max_turns
        self.out_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.turns, self.tool_calls, self.resubmits = 1, 0, 0
        self.turn_start = 0  # where the current turn's model tokens begin in out_ids
        self.done, self.stop_reason = False, ""
        self.part: PartialSample | None = None

    def budget(self) -> int:
        used_in_turn = len(self.out_ids) - self.turn_start
        return min(self.turn_tokens - used_in_turn, self.total_tokens - len(self.out_ids))

    def start_round(self) -> PartialSample | None:
        """The generation this sample needs now (None when it has ended)."""
        if self.done:
            return None
        if self.budget() <= 0:
            self.finish("length")
            return None
        first = self.calls
        self.part = PartialSample(self.prompt_ids + self.out_ids, self.budget(),
                                  None if self.seed is None else lambda k: self.seed(first + k))
        return self.part

    def end_round(self, stop_ids: list[int]) -> bool:
        """Take the round's tokens; True when the turn stopped at a stop id (a call
        may have been written: the caller reads the turn and decides)."""
        part, self.part = self.part, None
        self.out_ids += part.out_ids
        self.logprobs += part.logprobs
        self.versions += part.versions
        self.mask += [1] * len(part.out_ids)
        self.resubmits += max(part.resubmits, 0)
        self.calls += part.resubmits + 1
        reason = part.sample().stop_reason
        if reason == "stop" and part.out_ids and part.out_ids[-1] in stop_ids:
            return True
        self.finish(reason)  # EOS, or the budget is spent
        return False

    def turn_ids(self) -> list[int]:
        return self.out_ids[self.turn_start:]

    def add_tool_result(self, ids: list[int]) -> None:
        """Append a tool's result (not the policy's tokens) and open the next turn; the
        episode ends instead when no turn or no room is left for it."""
        if self.turns >= self.max_turns:
            self.finish("max_turns")
        elif len(self.out_ids) + len(ids) >= self.total_tokens:
            self.finish("length")
        else:
            self.out_ids += ids
            self.logprobs += [0.0] * len(ids)
            self.versions += [-1] * len(ids)
            self.mask += [0] * len(ids)
            self.turns += 1
            self.tool_calls += 1
            self.turn_start = len(self.out_ids)

    def finish(self, reason: str) -> None:
        self.done, self.stop_reason = True, reason

    def sample(self) -> Sample:
        return Sample(prompt_ids=self.prompt_ids, output_ids=self.out_ids,
                      logprobs=self.logprobs, versions=self.versions,
                      stop_reason=self.stop_reason or "length", n_resubmits=self.resubmits,
                      loss_mask=self.mask, n_turns=self.turns, tool_calls=self.tool_calls)


class ToolWorkflow:
    """`group_size` multi-turn samples of one prompt; tools named in `tools`
    (areal_ray/rollout/workflows/tools.py). `call_end` must be one token of the model's
    tokenizer: the engine stops there so the workflow can look for a call."""

    def __init__(self, config: EpisodeConfig, tools=("calculator",), max_turns: int = 4,
                 max_total_tokens: int = 512, result_format: str = "={}\n",
                 call_end: str = ")", tool_timeout_s: float = 10.0):
        self.check(config, tools, max_turns, max_total_tokens, result_format, call_end,
                   tool_timeout_s)
        self.config = config
        self.tools = build_tools(list(tools))
        self.runner = ToolRunner(tool_timeout_s)
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.result_format, self.call_end = result_format, call_end
        self._stop_ids: list[int] | None = None

    @staticmethod
    def check(config: EpisodeConfig, tools=("calculator",), max_turns: int = 4,
              max_total_tokens: int = 512, result_format: str = "={}\n",
              call_end: str = ")", tool_timeout_s: float = 10.0) -> None:
        """Raise PluginError naming the bad `rollout.workflow_kwargs` entry (called
        before Ray starts, and by the constructor)."""
        where = "rollout.workflow_kwargs"
        if isinstance(tools, str) or not hasattr(tools, "__iter__"):
            raise PluginError(f"{where}.tools must be a list of tool names, got {tools!r}")
        build_tools(list(tools))
        if not isinstance(max_turns, int) or max_turns < 1:
            raise PluginError(f"{where}.max_turns must be an integer >= 1, got {max_turns!r}")
        if not isinstance(max_total_tokens, int) or max_total_tokens < 1:
            raise PluginError(f"{where}.max_total_tokens must be an integer >= 1, "
                              f"got {max_total_tokens!r}")
        try:
            result_format.format("1")
        except (AttributeError, IndexError, KeyError, ValueError) as e:
            raise PluginError(f"{where}.result_format {result_format!r} must be a format "
                              f"string with one {{}} for the result: {e}") from e
        if not isinstance(call_end, str) or not call_end:
            raise PluginError(f"{where}.call_end must be a non-empty string, got {call_end!r}")
        if isinstance(tool_timeout_s, bool) or not isinstance(tool_timeout_s, (int, float)) \
                or not tool_timeout_s > 0:
            raise PluginError(f"{where}.tool_timeout_s must be a number of seconds > 0 (the "
                              f"wall-clock bound of one tool call), got {tool_timeout_s!r}")

    async def stop_ids(self, client: EngineClient) -> list[int]:
        if self._stop_ids is None:
            ids = await client.encode(self.call_end)
            if len(ids) != 1:
                raise PluginError(f"rollout.workflow_kwargs.call_end {self.call_end!r} is "
                                  f"{len(ids)} tokens of this model's tokenizer ({ids}): "
                                  "the engine stops on one token id")
            self._stop_ids = ids
        return self._stop_ids

    async def run_tool(self, client: EngineClient, call: ToolCall) -> list[int]:
        result = await self.runner.run(self.tools[call.name], call.arguments)
        return await client.encode(self.result_format.format(result))

    async def arun_episode(self, client: EngineClient, row: dict) -> Group:
        c = self.config
        stop_ids = await self.stop_ids(client)
        prompt_ids = await client.encode(str(row["prompt"]))
        seeder = c.seeder(int(row.get("pos", -1)))
        episodes = [ToolEpisode(prompt_ids, c.max_new_tokens, self.max_total_tokens,
                                self.max_turns, None if seeder is None else functools.partial(seeder, i))
                    for i in range(c.group_size)]
        while running := [(e, p) for e in episodes if (p := e.start_round()) is not None]:
            await generate_rounds(client.generate_batch, [p for _, p in running],
                                  c.temperature, stop_ids)
            paused = [e for e, _ in running if e.end_round(stop_ids)]
            if not paused:
                continue
            texts = await client.decode_batch([e.turn_ids() for e in paused])
            calls = [(e, find_call(t, self.tools)) for e, t in zip(paused, texts)]
            ready = [(e, call) for e, call in calls if isinstance(call, ToolCall)]
            results = await asyncio.gather(*[self.run_tool(client, call) for _, call in ready])
            for (e, _), ids in zip(ready, results):
                e.add_tool_result(ids)
            # A stop that closes no call (an inner parenthesis, or no call at all) only
            # paused the turn: it goes on in the next round.
        samples = [e.sample() for e in episodes]
        texts = await client.decode_batch([s.output_ids for s in samples])
        for s, text in zip(samples, texts):
            s.text = text
        return group_of(row, samples)
