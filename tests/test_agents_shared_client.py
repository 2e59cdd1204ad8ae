"""docs/agents.md's one client per process: the examples' shared clients, on asyncio and trio.

A rollout's client is ``BASE.with_options(base_url=ctx.base_url, api_key=ctx.api_key)`` over one base
client per process (sync agents, in worker threads) or per event loop (async agents): every rollout
then sends through the one HTTP client of its base, on its own session. What is asserted: each
rollout's calls reach its own session (its row holds its own conversation, on one branch), every
copy sends through the base's HTTP client, the base stays open across ``generate()`` calls, and the
async one is one per event loop (``RunVar``). The Anthropic recipe runs as the page writes it.
"""

from __future__ import annotations

import importlib.util
import re
import ssl
from pathlib import Path
from types import ModuleType
from typing import Any

import anthropic
import openai

from skyrl_structured import TrajectoryID
from skyrl_structured.agents import AgentContext, StructuredAgentGenerator
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.types import GeneratorInput
from tests._agents import hermes_template, with_template

ROOT = Path(__file__).resolve().parent.parent
TLS = ssl.create_default_context()
CALL_TEXT = 'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "%d + 3"}}\n</tool_call>'


def _rows(n: int) -> GeneratorInput:
    return {
        "prompts": [[{"role": "user", "content": f"What is {i} + 3?"}] for i in range(n)],
        "env_classes": ["agent"] * n,
        "env_extras": [{"reward_spec": {"ground_truth": str(i + 3)}} for i in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i}", 0) for i in range(n)],
    }


def _doc_block(first_line: str) -> str:
    text = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```python\n(" + re.escape(first_line) + r".*?)```", text, re.DOTALL)
    return str(block)


def _module(source: str, name: str, folder: Path) -> ModuleType:
    path = folder / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _answer_engine(model: Any) -> ScriptedEngine:
    """Each call answered ``#### <the row's sum>``, read from the row's question in the prompt."""

    def reply(call: Any) -> str:
        (number,) = re.findall(r"What is (\d+) \+ 3\?", model.decode(call.prompt_token_ids))
        return f"#### {int(number) + 3}"

    return ScriptedEngine(model, reply)


async def test_sync_agents_share_one_openai_client_through_with_options(tokenizer, anyio_backend):
    base = openai.OpenAI(api_key="unused", max_retries=0, http_client=openai.DefaultHttpxClient(verify=TLS))
    copies: list[Any] = []

    def agent(ctx: AgentContext) -> float:
        client = base.with_options(base_url=ctx.base_url, api_key=ctx.api_key)
        copies.append(client)
        messages: list[Any] = list(ctx.prompt)
        for _ in range(2):
            reply = client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            messages += [{"role": "user", "content": "Sure?"}]
        answer = str(messages[-2]["content"])
        return 1.0 if answer == f"#### {ctx.env_extras['reward_spec']['ground_truth']}" else 0.0

    try:
        generator = StructuredAgentGenerator(_answer_engine(tokenizer), tokenizer, agent, max_agent_threads=4)
        for _ in range(2):  # the base outlives a generate() call
            out = await generator.generate(_rows(8))
            assert [r[-1] for r in out["rewards"]] == [1.0] * 8  # type: ignore[index]
            metrics = out["rollout_metrics"] or {}
            assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (16, 8)
        await generator.aclose()
        assert len(copies) == 16
        assert all(copy._client is base._client for copy in copies)
        assert not base.is_closed()
    finally:
        base.close()


async def test_async_agents_share_one_client_per_event_loop(tokenizer, anyio_backend, tmp_path):
    docs = _module(
        _doc_block("import ssl\n\nimport openai\nfrom anyio.lowlevel import RunVar"), "loop_client", tmp_path
    )
    bases: list[Any] = []

    async def agent(ctx: AgentContext) -> float:
        bases.append(docs.openai_client())
        client = docs.openai_client().with_options(base_url=ctx.base_url, api_key=ctx.api_key)
        reply = await client.chat.completions.create(model=ctx.model, messages=list(ctx.prompt))
        answer = reply.choices[0].message.content
        return 1.0 if answer == f"#### {ctx.env_extras['reward_spec']['ground_truth']}" else 0.0

    generator = StructuredAgentGenerator(_answer_engine(tokenizer), tokenizer, agent)
    try:
        for _ in range(2):
            out = await generator.generate(_rows(8))
            assert [r[-1] for r in out["rewards"]] == [1.0] * 8  # type: ignore[index]
        (base,) = {id(b): b for b in bases}.values()  # one client for the loop, across generate() calls
        assert len(bases) == 16
        assert not base.is_closed()
    finally:
        await generator.aclose()
        await docs.openai_client().close()  # this loop's: a test leaves no socket open


def test_a_loop_client_is_not_carried_into_another_loop(tmp_path):
    """``RunVar``: each event loop run gets its own client (a pool's connections belong to their loop)."""
    import anyio

    docs = _module(
        _doc_block("import ssl\n\nimport openai\nfrom anyio.lowlevel import RunVar"), "loop_client2", tmp_path
    )

    async def take() -> Any:
        client = docs.openai_client()
        assert docs.openai_client() is client
        await client.close()
        return client

    first, second = anyio.run(take), anyio.run(take, backend="trio")
    assert first is not second


async def test_the_anthropic_recipe_runs_as_written_with_its_shared_client(tokenizer, anyio_backend, tmp_path):
    recipe = _module(_doc_block("# claude_style.py: run with agent=claude_style:messages_agent"), "claude", tmp_path)
    # The page leaves the tool's body out (`...`); the agent looks it up in its module when it runs.
    recipe.calculate = lambda expression: str(sum(int(x) for x in expression.split("+")))  # type: ignore[attr-defined]
    model = with_template(tokenizer, hermes_template(strip_think=False))

    def reply(call: Any) -> str:
        prompt = model.decode(call.prompt_token_ids)
        (number,) = re.findall(r"What is (\d+) \+ 3\?", prompt)
        return f"#### {int(number) + 3}" if "<tool_response>" in prompt else CALL_TEXT % int(number)

    try:
        generator = StructuredAgentGenerator(ScriptedEngine(model, reply), model, recipe.messages_agent)
        out = await generator.generate(_rows(4))
        await generator.aclose()
        assert [r[-1] for r in out["rewards"]] == [1.0] * 4  # type: ignore[index]
        metrics = out["rollout_metrics"] or {}
        assert (metrics["generate/agent_calls"], metrics["generate/agent_branches"]) == (8, 4)
        assert isinstance(recipe.CLAUDE, anthropic.Anthropic)
        assert not recipe.CLAUDE.is_closed()
    finally:
        recipe.CLAUDE.close()
