"""Real agent clients against the capture endpoint: mini-swe-agent 2.x on LiteLLM, the OpenAI Agents SDK.

On asyncio and trio, each client as its users run it, with a scripted model (its replies are Hermes tool
calls the endpoint parses) behind the endpoint: every row token-exact against the engine's own ids, every
reward right. mini-swe-agent runs as ``docs/agents.md`` writes it (the test takes the recipe's code block
from the page): in a worker thread and as a ``command:`` agent, and past its deadline. The Agents SDK
runs with ``OpenAIChatCompletionsModel``, on the event loop on asyncio and in a worker thread with its own
asyncio loop on trio (it creates asyncio tasks), through ``Runner.run`` and ``Runner.run_streamed``; and the
docs' recipe for its default model (the Responses API), as written, with the SDK's default model settings.

The clients come from the ``agent-clients`` extra (``scripts/setup`` installs it); without it these tests
are skipped. Nothing here needs the network: LiteLLM is kept offline by the recipe's environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread
import pytest

from skyrl_structured import TrajectoryID
from skyrl_structured.agents import AgentContext, StructuredAgentGenerator, command_agent
from skyrl_structured.envs._threads import wait_env_thread_calls
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine
from skyrl_structured.types import GeneratorInput, GeneratorOutput
from skyrl_structured.validate import validate_generator_output
from tests._agents import (
    assert_closed,
    close_litellm_clients,
    hermes_template,
    placeholder,
    port_of,
    question,
    row,
    with_template,
)
from tests._pids import dead, gone_within_bound, pids_in
from tests._upstream import skyrl_validate_generator_output
from tests.helpers import run_asyncio

pytest.importorskip(
    "minisweagent", reason="mini-swe-agent is in the agent-clients extra: pip install -e '.[agent-clients]'"
)
pytest.importorskip(
    "agents", reason="the OpenAI Agents SDK is in the agent-clients extra: pip install -e '.[agent-clients]'"
)

pytestmark = [
    pytest.mark.anyio,
    # At its first call LiteLLM imports modules of its own whose TypedDicts pydantic warns about (litellm 1.110.2,
    # pydantic 2.14: its GitHub Copilot `_DeviceCode`, `_GithubUserPayload`); as an error, LiteLLM would fail that
    # call and mini-swe-agent retry it for minutes.
    pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning"),
]

ROOT = Path(__file__).resolve().parent.parent

#: A deadline that only runs once the agent's shell command is running (the clock is paused before).
DEADLINE = 0.5
#: How long the thread agent gets to return once its session closed; the hung one never does in time.
CLEANUP_S = 0.2
#: A bound only a hang reaches.
HANG_S = 60.0


# ------------------------------------------------------------------ the scripted model and what it sampled


def tool_call(name: str, **arguments: Any) -> str:
    """A Hermes tool call as Qwen2.5/Qwen3 write one (the endpoint parses it into ``tool_calls``)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedModel:
    """An engine handler: row ``r``'s ``k``-th call gets ``turns(r, k, prompt)`` (``prompt``: the call's prompt as
    text); each call and the ids sampled for it
    are kept by row, in order (``calls[r]``), so a row can be checked against exactly what the engine did."""

    def __init__(self, tokenizer: Any, turns: Callable[[int, int, str], str]) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.calls: dict[int, list[tuple[EngineCall, list[int]]]] = {}

    def __call__(self, call: EngineCall) -> Reply:
        r = question(self.tokenizer, call)
        made = self.calls.setdefault(r, [])
        text = self.turns(r, len(made), self.tokenizer.decode(call.prompt_token_ids))
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        made.append((call, ids))
        return Reply(text, token_ids=ids)


def assert_token_exact(out: GeneratorOutput, r: int, calls: list[tuple[EngineCall, list[int]]]) -> None:
    """Row ``r`` is its session's calls on one branch: the first call's prompt, then per call the ids the engine
    sampled (loss mask 1, the engine's logprobs) and the tail the next call's prompt added (loss mask 0)."""
    (session,) = {call.session_id for call, _ in calls}
    assert session is not None
    prompt = calls[0][0].prompt_token_ids
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for call, sampled in calls:
        so_far = prompt + response
        assert call.prompt_token_ids[: len(so_far)] == so_far, "a call did not extend its row's branch"
        tail = call.prompt_token_ids[len(so_far) :]
        response += tail + sampled
        mask += [0] * len(tail) + [1] * len(sampled)
        logprobs += [0.0] * len(tail) + [-0.5 - 0.01 * k for k in range(len(sampled))]
    got = row(out, r)
    assert got["prompt"] == prompt
    assert got["response"] == response
    assert got["mask"] == mask
    assert got["lp"] == pytest.approx(logprobs)


def batch(n: int) -> GeneratorInput:
    """``n`` rows asking "What is i + 3?", graded by their ``reward_spec`` as the embedded dataset's rows are."""
    return {
        "prompts": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(n)],
        "env_classes": ["agent"] * n,
        "env_extras": [{"reward_spec": {"method": "rule", "ground_truth": str(i + 3)}} for i in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(n)],
    }


@pytest.fixture(scope="module")
def hermes(tokenizer: Any) -> Any:
    """The tiny tokenizer with a Hermes template: tool calls and tool results rendered as Qwen2.5's are."""
    return with_template(tokenizer, hermes_template(strip_think=False))


# ------------------------------------------------------------------ mini-swe-agent (the docs' recipe)

#: The submission command mini-swe-agent recognises: its first output line, then the answer.
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo {answer}"


def recipe_source() -> str:
    """The mini-swe-agent recipe's code block in docs/agents.md, as a reader would copy it."""
    text = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```python\n(# mini_swe_agent\.py:.*?)```", text, flags=re.DOTALL)
    return str(block)


#: What the recipe sets in the environment before it imports LiteLLM.
RECIPE_ENV = (
    "LITELLM_OFFLINE_MODE",
    "LITELLM_LOCAL_MODEL_COST_MAP",
    "MSWEA_SILENT_STARTUP",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT",
)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """The recipe as a file (for the command agent) and as an imported module (for the thread agent).

    mini-swe-agent's global settings go to a directory of this test's own while it runs (its import reads
    a ``.env`` there); the recipe itself keeps LiteLLM offline.
    """
    folder = tmp_path_factory.mktemp("recipe")
    path = folder / "mini_swe_agent.py"
    path.write_text(recipe_source(), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(folder / "mswea"))
        for name in RECIPE_ENV:
            patch.delenv(name, raising=False)  # set again by the recipe, and undone when the module's tests end
        spec = importlib.util.spec_from_file_location("mini_swe_agent_recipe", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert os.environ["LITELLM_OFFLINE_MODE"] == "true"
        yield module
    close_litellm_clients()


def mini_turns(wrong: set[int]) -> Callable[[int, int, str], str]:
    """mini-swe-agent's model: ``echo hi``, then the submission (``i + 3``, or ``i + 2`` for rows in ``wrong``)."""

    def turns(r: int, k: int, prompt: str) -> str:
        if k == 0:
            return "Let me look first.\n" + tool_call("bash", command="echo hi")
        answer = f"$(({r} + {2 if r in wrong else 3}))"
        return tool_call("bash", command=SUBMIT.format(answer=answer))

    return turns


def assert_saw_its_tool_result(hermes: Any, calls: list[tuple[EngineCall, list[int]]]) -> None:
    """The second call's prompt holds the first tool call's result as mini-swe-agent's config renders it."""
    assert len(calls) == 2
    second = hermes.decode(calls[1][0].prompt_token_ids)
    assert '<tool_response>\n{\n  "returncode": 0,\n  "output": "hi\\n"\n}\n</tool_response>' in second


async def test_mini_swe_agent_in_a_thread_is_captured_token_exact(hermes, anyio_backend, recipe):
    model = ScriptedModel(hermes, mini_turns(wrong={1}))
    engine = ScriptedEngine(hermes, model)
    out = await StructuredAgentGenerator(engine, hermes, recipe.solve).generate(batch(2))
    validate_generator_output(2, out)
    skyrl_validate_generator_output(2, out)
    assert [r[-1] for r in out["rewards"]] == [1.0, 0.0]  # type: ignore[index]
    assert out["stop_reasons"] == ["stop", "stop"]
    for r in range(2):
        assert_saw_its_tool_result(hermes, model.calls[r])
        assert_token_exact(out, r, model.calls[r])
    assert model.calls[0][0][0].session_id != model.calls[1][0][0].session_id
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (4, 2)
    assert metrics["generate/agent_multi_branch_rollouts"] == 0


async def test_mini_swe_agent_as_a_command_is_captured_token_exact(hermes, anyio_backend, recipe):
    model = ScriptedModel(hermes, mini_turns(wrong=set()))
    engine = ScriptedEngine(hermes, model)
    agent = command_agent([sys.executable, recipe.__file__])
    out = await StructuredAgentGenerator(engine, hermes, agent).generate(batch(1))
    validate_generator_output(1, out)
    assert [r[-1] for r in out["rewards"]] == [1.0]  # type: ignore[index]
    assert_saw_its_tool_result(hermes, model.calls[0])
    assert_token_exact(out, 0, model.calls[0])
    assert (out["rollout_metrics"] or {})["generate/agent_branches"] == 1


def hanging_turns(pidfile: Path, command: str) -> Callable[[int, int, str], str]:
    """The model's first call runs ``command`` once its shell wrote its pid (and ``$!``, if any) to ``pidfile``."""

    def turns(r: int, k: int, prompt: str) -> str:
        return tool_call("bash", command=command.format(pids=pidfile))

    return turns


async def generate_paused_until(generator: StructuredAgentGenerator, pidfile: Path, input_batch: GeneratorInput) -> Any:
    """``generator.generate(input_batch)``, its clock paused until ``pidfile`` exists (the shell command is running)."""
    result: dict[str, GeneratorOutput] = {}

    async def run() -> None:
        result["out"] = await generator.generate(input_batch)

    async with anyio.create_task_group() as group:
        generator.pause()
        group.start_soon(run)
        with anyio.fail_after(HANG_S):  # the agent never ran its command: fail, rather than wait for pytest's bound
            while not pidfile.exists():  # noqa: ASYNC110, ASYNC240 - written by another process: one stat per poll
                await anyio.sleep(0.01)
        generator.resume()
    return result["out"]


async def test_a_mini_swe_agent_command_past_its_deadline_leaves_no_process(hermes, anyio_backend, recipe, tmp_path):
    pidfile = tmp_path / "pids"
    # The shell (mini-swe-agent starts it with start_new_session=True) and its background child both hang.
    command = "sleep 1000 & echo $$ $! > {pids}.tmp && mv {pids}.tmp {pids} && wait"
    engine = ScriptedEngine(hermes, ScriptedModel(hermes, hanging_turns(pidfile, command)))
    agent = command_agent([sys.executable, recipe.__file__])
    generator = StructuredAgentGenerator(
        engine, hermes, agent, rollout_timeout_s=DEADLINE, skip_failed_rollouts=True, failure_budget_action="warn"
    )
    with anyio.fail_after(HANG_S):
        out = await generate_paused_until(generator, pidfile, batch(1))
    assert row(out, 0) == {**placeholder(hermes.pad_token_id), "lp": None}  # no row sampled: no logprobs
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/num_timed_out_rollouts"], metrics["generate/failures/TimeoutError"]) == (1, 1)
    pids = pids_in(pidfile)
    assert len(pids) == 2  # the shell in its own session, and the sleep it started
    await gone_within_bound(pids)


class HungThreadAgent:
    """The recipe's agent in a thread, its shell command hung until ``release()``; keeps how its run ended."""

    def __init__(self, recipe: ModuleType, hold: Path) -> None:
        self.recipe = recipe
        self.hold = hold
        os.mkfifo(hold)
        self.ended = threading.Event()
        self.outcome: BaseException | dict[str, Any] | None = None
        self.base_url = ""

    def __call__(self, ctx: AgentContext) -> float:
        self.base_url = ctx.base_url
        try:
            task = ctx.prompt[-1]["content"]
            self.outcome = self.recipe.run_agent(ctx.base_url, ctx.api_key, ctx.model, task, timeout=int(HANG_S * 10))
        except BaseException as exc:
            self.outcome = exc
            raise
        finally:
            self.ended.set()
        return 1.0

    def release(self) -> None:
        """Let the hung command (``cat`` on the fifo) end; nothing to do when it already has."""
        with contextlib.suppress(OSError):  # ENXIO: no reader any more
            os.close(os.open(self.hold, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("kept", [False, True], ids=["endpoint_per_call", "endpoint_kept"])
async def test_a_mini_swe_agent_thread_ends_its_rollout_within_the_deadline_plus_the_cleanup_bound(
    hermes, anyio_backend, recipe, tmp_path, caplog, kept
):
    """``kept``: the endpoint stays up across ``generate()`` calls (``serving()``), else it closes with the call,
    as in SkyRL's trainer. Either way the abandoned agent's next call meets the ended session's 404 (from the
    live endpoint, or from the closed one's tombstone), which ends its run at once without a retry; without
    ``serving()``, the port closes once the agent has returned."""
    pidfile = tmp_path / "pids"
    agent = HungThreadAgent(recipe, tmp_path / "hold")
    command = f"echo $$ > {{pids}}.tmp && mv {{pids}}.tmp {{pids}} && cat {agent.hold}"
    engine = ScriptedEngine(hermes, ScriptedModel(hermes, hanging_turns(pidfile, command)))
    generator = StructuredAgentGenerator(
        engine,
        hermes,
        agent,
        rollout_timeout_s=DEADLINE,
        env_cleanup_timeout_s=CLEANUP_S,
        skip_failed_rollouts=True,
        failure_budget_action="warn",
        agent_endpoint_workers=0,  # the in-loop endpoint's tombstone (workers keep their ports until aclose())
    )
    released_first = False

    async def watchdog() -> None:
        nonlocal released_first
        await anyio.sleep(HANG_S)
        released_first = True
        agent.release()

    try:
        async with generator.serving() if kept else contextlib.nullcontext(), anyio.create_task_group() as outer:
            outer.start_soon(watchdog)
            out = await generate_paused_until(generator, pidfile, batch(1))
            (pid,) = pids_in(pidfile)
            assert not released_first, "generate() waited on the agent's thread until the watchdog released it"
            assert not dead(pid)  # returned while the shell command still hangs in the agent's thread
            assert not agent.ended.is_set()
            agent.release()
            with anyio.fail_after(HANG_S):
                assert await anyio.to_thread.run_sync(agent.ended.wait, HANG_S)
            outer.cancel_scope.cancel()
    finally:
        agent.release()
    assert row(out, 0) == {**placeholder(hermes.pad_token_id), "lp": None}  # no row sampled: no logprobs
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/num_timed_out_rollouts"], metrics["generate/env_cleanup_timeouts"]) == (1, 1)
    # Its next call failed once, and mini-swe-agent did not retry it (no tenacity "Retrying" warning): the run
    # ended there, and its thread with it.
    from litellm.exceptions import NotFoundError

    assert isinstance(agent.outcome, NotFoundError), agent.outcome  # not a connection error, which LiteLLM retries
    assert "rollout q0_0 has ended" in str(agent.outcome)
    assert ("and so has the generate() call" in str(agent.outcome)) is not kept  # the tombstone's answer
    assert not [r for r in caplog.records if r.name == "litellm_model"]
    with anyio.fail_after(HANG_S):
        assert await anyio.to_thread.run_sync(wait_env_thread_calls, HANG_S)
        await gone_within_bound([pid])
        await assert_closed(port_of(agent.base_url))  # the tombstone ended with the agent (kept: the endpoint did)


# ------------------------------------------------------------------ the OpenAI Agents SDK (chat completions)


def sdk_turns(wrong: set[int]) -> Callable[[int, int, str], str]:
    """The SDK agent's model: an ``add`` call (``i + 3``, or ``i + 2`` for rows in ``wrong``), then the tool's
    result as its prompt shows it, so the answer is right only if the SDK ran the tool and sent its output back."""

    def turns(r: int, k: int, prompt: str) -> str:
        if k == 0:
            return tool_call("add", a=r, b=2 if r in wrong else 3)
        (result,) = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt)
        return str(result)

    return turns


def sdk_agent(backend: str, *, streamed: bool) -> Any:
    """An Agents SDK agent with an ``add`` tool on ``OpenAIChatCompletionsModel``: on the event loop on asyncio,
    in a worker thread with its own asyncio loop on trio; its reward is whether its final output is the answer."""
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    @function_tool
    def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    async def solve(ctx: AgentContext) -> float:
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            model = OpenAIChatCompletionsModel(model=ctx.model, openai_client=client)
            agent = Agent(name="solver", instructions="Add with the tool.", model=model, tools=[add])
            config = RunConfig(tracing_disabled=True)  # else the SDK uploads traces to OpenAI
            task = ctx.prompt[-1]["content"]
            if streamed:
                result: Any = Runner.run_streamed(agent, task, run_config=config)
                events = [event.type async for event in result.stream_events()]
                assert events.count("run_item_stream_event") == 3  # the tool call, its output, the message
            else:
                result = await Runner.run(agent, task, run_config=config)
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
        return float(str(result.final_output).strip() == ctx.env_extras["reward_spec"]["ground_truth"])

    if backend == "asyncio":
        return solve

    def in_thread(ctx: AgentContext) -> float:
        return run_asyncio(solve(ctx))

    return in_thread


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_the_agents_sdk_on_chat_completions_is_captured_token_exact(hermes, anyio_backend, streamed):
    backend = anyio_backend if isinstance(anyio_backend, str) else anyio_backend[0]
    model = ScriptedModel(hermes, sdk_turns(wrong={1}))
    engine = ScriptedEngine(hermes, model)
    out = await StructuredAgentGenerator(engine, hermes, sdk_agent(backend, streamed=streamed)).generate(batch(2))
    validate_generator_output(2, out)
    skyrl_validate_generator_output(2, out)
    assert [r[-1] for r in out["rewards"]] == [1.0, 0.0]  # type: ignore[index]
    assert out["stop_reasons"] == ["stop", "stop"]
    for r in range(2):
        assert len(model.calls[r]) == 2
        assert_token_exact(out, r, model.calls[r])
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (4, 2)


# ------------------------------------------------------------------ the OpenAI Agents SDK recipe (its default model)


def sdk_recipe_source() -> str:
    """The Agents SDK recipe's code block in docs/agents.md, as a reader has it."""
    text = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    (block,) = re.findall(
        r"```python\n(# my_agents\.py: run with agent=my_agents:sdk_default_agent.*?)```", text, re.DOTALL
    )
    return str(block)


def calculator_turns(wrong: set[int]) -> Callable[[int, int, str], str]:
    """The recipe's model: a ``calculator`` call, then ``#### i + 3`` (``i + 2`` for rows in ``wrong``)."""

    def turns(r: int, k: int, prompt: str) -> str:
        if k == 0:
            return tool_call("calculator", expression=f"{r} + 3")
        return f"#### {r + (2 if r in wrong else 3)}"

    return turns


async def test_the_agents_sdk_recipe_runs_with_the_sdks_default_model_settings(
    hermes, anyio_backend, tmp_path, monkeypatch
):
    """Issue 47: the SDK's default model settings send ``reasoning={"effort": "none"}`` and ``text.verbosity``,
    which the endpoint refused with a 400; the recipe runs as written, its rows token-exact."""
    from agents.models import get_default_model_settings

    monkeypatch.delenv("OPENAI_DEFAULT_MODEL", raising=False)  # the SDK's own default model and its settings
    settings = get_default_model_settings()
    assert settings.reasoning is not None  # what this test is about: the settings the SDK sends by default
    assert settings.verbosity is not None
    path = tmp_path / "my_agents.py"
    path.write_text(sdk_recipe_source(), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("my_agents_sdk_recipe", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = ScriptedModel(hermes, calculator_turns(wrong={1}))
    engine = ScriptedEngine(hermes, model)
    out = await StructuredAgentGenerator(engine, hermes, module.sdk_default_agent).generate(batch(2))
    validate_generator_output(2, out)
    skyrl_validate_generator_output(2, out)
    assert [r[-1] for r in out["rewards"]] == [1.0, 0.0]  # type: ignore[index]
    for r in range(2):
        assert len(model.calls[r]) == 2
        assert_token_exact(out, r, model.calls[r])
