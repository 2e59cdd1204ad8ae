"""Choosing an agent by a configuration value, and the embedded default agent.

``resolve_agent`` turns ``default``, ``module.path:function`` and ``command:<command line>`` into an
agent, or refuses the value in one line naming the key. The default agent runs here through
:class:`StructuredAgentGenerator` with the official ``openai`` client, on asyncio and trio, against a
scripted engine, so every tool turn and reward is known in advance.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from skyrl_structured import TrajectoryID
from skyrl_structured.agents import (
    AgentContext,
    StructuredAgentGenerator,
    check_agent_choice,
    command_agent,
    default_agent,
    resolve_agent,
)
from skyrl_structured.agents._default import FINAL_ANSWER_PROMPT, calculate
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.types import GeneratorInput
from tests._agents import hermes_template, with_template
from tests._upstream import skyrl_validate_generator_output
from tests.helpers import token_rewards

AGENT_MODULE = """
import anyio

async def solve(ctx):
    return 0.5

def blocking(ctx):
    return 0.5

class Holder:
    async def method(self, ctx):
        return 0.5

holder = Holder()
NOT_CALLABLE = 3
"""


@pytest.fixture
def agent_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"my_agents_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_default_and_module_function_resolve_to_the_named_agents(agent_module):
    assert resolve_agent("default") is default_agent
    assert resolve_agent(" default ") is default_agent
    module = sys.modules.get(agent_module) or __import__(agent_module)
    assert resolve_agent(f"{agent_module}:solve") is module.solve
    assert resolve_agent(f"{agent_module}:holder.method") == module.holder.method
    assert resolve_agent(f"{agent_module}:blocking") is module.blocking  # a sync agent: run in a worker thread


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("solve", r"^`agent`='solve' is not an agent: give `default` \(the embedded"),
        ("", r"^`agent` must name an agent, got '': give `default`"),
        (3, r"^`agent` must name an agent, got 3: give"),
        (
            "no_such_module_xyz:solve",
            r"^`agent=no_such_module_xyz:solve`: cannot import module 'no_such_module_xyz' "
            r"\(ModuleNotFoundError: No module named 'no_such_module_xyz'\); check the name",
        ),
        ("{mod}:missing", r"^`agent={mod}:missing`: module '{mod}' has no attribute 'missing'; name the agent"),
        ("{mod}:NOT_CALLABLE", r"^`agent={mod}:NOT_CALLABLE` is a int, not a function"),
        ("command:", r"^`agent`: the command line after `command:` is empty; e.g. `command:python my_agent.py`$"),
        (
            "command:python 'unclosed",
            r"^`agent`: cannot split the command line \"python 'unclosed\" \(No closing "
            r"quotation\); check its quotes$",
        ),
        (
            "command:no-such-agent-binary --x",
            r"^`agent`: the command 'no-such-agent-binary' is not an executable "
            r"file on PATH; give its path or install it$",
        ),
        ("command:./missing.sh", r"^`agent`: the command './missing.sh' is not an executable file; give its path"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_the_key(agent_module, value, message):
    if isinstance(value, str):
        value = value.format(mod=agent_module)
    with pytest.raises(ValueError, match=message.format(mod=agent_module)) as caught:
        resolve_agent(value)
    assert "\n" not in str(caught.value)


def test_the_key_is_named_as_the_caller_spells_it_and_vlm_is_refused_alongside():
    with pytest.raises(ValueError, match=r"^`generator.agent`='x' is not an agent"):
        resolve_agent("x", key="generator.agent")
    with pytest.raises(ValueError, match=r"^`generator.agent` and `generator.vision_language_generator=true` both"):
        check_agent_choice("default", key="generator.agent", vision_language_generator=True)
    assert check_agent_choice("default", key="agent", vision_language_generator=False) is default_agent


@pytest.mark.parametrize(
    ("expression", "value"),
    [("4 * 9", "36"), ("7 / 2", "3.5"), ("-(3 + 5) * 2", "-16"), ("50 - 18", "32")],
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 8", "1 / 0", "x + 1", "3 +"])
def test_the_calculator_reports_what_it_refuses_as_its_answer(expression):
    assert calculate(expression).startswith("error: ")


# ------------------------------------------------------------------ the default agent, end to end


def batch(*truths: int) -> GeneratorInput:
    n = len(truths)
    return {
        "prompts": [
            [{"role": "user", "content": f"Tom has {t - 5} apples and buys 5 more. How many?"}] for t in truths
        ],
        "env_classes": ["gsm8k"] * n,
        "env_extras": [{"reward_spec": {"method": "rule", "ground_truth": str(t)}} for t in truths],
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(n)],
    }


class Recording:
    """The default agent, keeping what each rollout returned (the generator keeps only the reward)."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}

    async def __call__(self, ctx: AgentContext) -> dict[str, Any]:
        result = await default_agent(ctx)
        self.results[ctx.rollout] = result
        return result


def _by_session(engine: ScriptedEngine) -> dict[Any, list[Any]]:
    calls: dict[Any, list[Any]] = {}
    for call in engine.calls:
        calls.setdefault(call.session_id, []).append(call)
    return calls


@pytest.mark.anyio
async def test_the_default_agent_makes_its_own_tool_call_when_the_model_does_not(tokenizer, anyio_backend):
    # The tiny ChatML template: no tools rendered, tool results as `tool` turns.
    engine = ScriptedEngine.from_replies(tokenizer, "Let me add them.", "So it is 8.", "#### 8")
    agent = Recording()
    out = await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(8, 9))
    skyrl_validate_generator_output(2, out)
    assert [r[-1] for r in token_rewards(out)] == [1.0, 0.0]  # "#### 8" against 8, then against 9
    assert agent.results["q0_0"] == {"reward": 1.0, "tool_calls": 1, "model_tool_calls": 0}
    assert agent.results["q1_0"] == {"reward": 0.0, "tool_calls": 1, "model_tool_calls": 0}
    sessions = _by_session(engine)
    assert sorted(len(calls) for calls in sessions.values()) == [3, 3]

    def row_of(calls: list[Any]) -> int:
        # The sessions' order is the order their first calls reached the engine: find each one's row
        # by the question its first prompt carries.
        first = tokenizer.decode(calls[0].prompt_token_ids)
        (row,) = [r for r, t in enumerate((8, 9)) if f"Tom has {t - 5} apples" in first]
        return row

    in_rows = sorted(sessions.values(), key=row_of)
    for row, (truth, calls) in enumerate(zip((8, 9), in_rows, strict=True)):
        second = tokenizer.decode(calls[1].prompt_token_ids)
        # The agent's own call adds the task's first two numbers; its result went back as a tool turn.
        assert f"<|im_start|>tool\n{truth}<|im_end|>\n<|im_start|>assistant\n" in second
        third = tokenizer.decode(calls[2].prompt_token_ids)
        assert third.endswith(
            f"So it is 8.<|im_end|>\n<|im_start|>user\n{FINAL_ANSWER_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
        )
        # One branch: every call extended the last, so the row starts at the first prompt.
        assert out["prompt_token_ids"][row] == calls[0].prompt_token_ids
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (6, 2)
    assert metrics["generate/agent_multi_branch_rollouts"] == 0


@pytest.mark.anyio
async def test_the_models_tool_calls_are_run_and_answered(tokenizer, anyio_backend):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4 * 9"}}\n</tool_call>'
    hermes = with_template(tokenizer, hermes_template(strip_think=False))
    engine = ScriptedEngine.from_replies(hermes, call, "It is 36.", "#### 36")
    agent = Recording()
    out = await StructuredAgentGenerator(engine, hermes, agent).generate(batch(36))
    skyrl_validate_generator_output(1, out)
    assert agent.results["q0_0"] == {"reward": 1.0, "tool_calls": 1, "model_tool_calls": 1}
    (calls,) = _by_session(engine).values()
    second = hermes.decode(calls[1].prompt_token_ids)
    assert "<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in second
    assert '"name": "calculator"' in hermes.decode(calls[0].prompt_token_ids)  # the tool was offered
    mask = out["loss_masks"][0]
    assert out["prompt_token_ids"][0] == calls[0].prompt_token_ids  # the Hermes template extends: one branch
    assert mask.count(1) == sum(
        len(hermes.encode(t, add_special_tokens=False)) + 1 for t in (call, "It is 36.", "#### 36")
    )
    metrics = out["rollout_metrics"] or {}
    assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (3, 1)


@pytest.mark.anyio
async def test_a_row_without_a_ground_truth_fails_its_rollout_saying_why(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "x")
    no_truth = batch(8)
    no_truth["env_extras"] = [{}]
    with pytest.raises(Exception, match=r"the default agent scores gsm8k-style rows, and this row's env extras"):
        await StructuredAgentGenerator(engine, tokenizer, default_agent).generate(no_truth)


AGENT_SCRIPT = textwrap.dedent(
    """
    import json, os, urllib.request
    body = {"model": os.environ["OPENAI_MODEL"], "messages": json.loads(os.environ["SKYRL_AGENT_PROMPT"])}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    reply = json.load(urllib.request.urlopen(request))["choices"][0]["message"]["content"]
    print(json.dumps({"reward": 1.0 if reply == "8" else 0.0}))
    """
)


@pytest.mark.anyio
async def test_a_command_value_runs_the_command_per_rollout(tokenizer, anyio_backend, tmp_path):
    script = tmp_path / "my_agent.py"
    script.write_text(AGENT_SCRIPT)
    agent = resolve_agent(f"command:{sys.executable} {script}")
    assert agent.__qualname__ == command_agent("x").__qualname__  # command_agent's agent, not another runner
    engine = ScriptedEngine.from_replies(tokenizer, "8")
    out = await StructuredAgentGenerator(engine, tokenizer, agent).generate(batch(8, 9))
    assert [r[-1] for r in token_rewards(out)] == [1.0, 1.0]
    assert len(engine.calls) == 2
    assert json.loads(json.dumps(out["stop_reasons"])) == ["stop", "stop"]
