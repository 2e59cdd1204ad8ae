"""The embedded default agent: a small calculator-tool loop written with the official ``openai`` client.

It is what ``skyrl-structured rollout agent=default`` runs against the offline tiny model, and an
example of the shape any agent takes: an async function of :class:`~._generator.AgentContext` that
talks to ``ctx.base_url`` and returns its reward.

The TLS context under its client is one per process (:func:`_tls`): ``openai.AsyncOpenAI`` left to
build its own HTTP client loads the system's certificates each time, about 30-55 ms of CPU on the
event loop per rollout, so a burst of 256 rollouts froze the loop for over ten seconds. The client
itself is one per rollout, closed with it, unlike the one-per-event-loop client docs/agents.md
recommends for agents of one's own (``base.with_options(base_url=..., api_key=...)``): this agent runs
in whatever event loop calls it (every test's, the command's), and an HTTP client's connections
belong to the loop that opened them and would be left open when that loop ends. The costly part of a
client per rollout is the context, and that one is shared.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import re
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import AgentError
from ._generator import AgentContext

if TYPE_CHECKING:  # openai is imported when the agent runs: the package does not require it
    from openai.types.chat import ChatCompletionFunctionToolParam

__all__ = ["CALCULATOR_TOOL", "FINAL_ANSWER_PROMPT", "MAX_TOOL_ROUNDS", "calculate", "default_agent"]

#: The one tool the default agent offers, as OpenAI's ``tools`` entry.
CALCULATOR_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. '4 * 9'"}},
            "required": ["expression"],
        },
    },
}

#: The last request's user message: the answer in the format the gsm8k check reads.
FINAL_ANSWER_PROMPT = "Now give only the final numeric answer, in the format '#### ANSWER'."

#: How many rounds of tool calls the model may make before it is asked for its final answer.
MAX_TOOL_ROUNDS = 3

_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """The calculator tool: the value of ``expression``, or ``"error: ..."`` (a tool reports, it does not raise)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return float(_OPERATORS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return f"{result:g}"


@functools.cache
def _tls() -> ssl.SSLContext:
    """The process's one TLS context for the agent's HTTP clients (never used over the endpoint's plain HTTP,
    but httpx builds one per client unless given one, and that is the cost)."""
    return ssl.create_default_context()


def _run_tool(name: str, arguments: str) -> str:
    if name != CALCULATOR_TOOL["function"]["name"]:
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return "error: give the expression as a string"
    return calculate(expression)


def _task_expression(prompt: list[Any]) -> str:
    """The agent's own calculator call: the first two numbers of the task's last user message, added."""
    text = next((str(m.get("content") or "") for m in reversed(prompt) if m.get("role") == "user"), "")
    numbers = re.findall(r"\d+(?:\.\d+)?", text)[:2]
    return " + ".join(numbers) or "0"


def _ground_truth(ctx: AgentContext) -> str:
    spec = ctx.env_extras.get("reward_spec")
    truth = spec.get("ground_truth") if isinstance(spec, dict) else None
    if truth is None:
        raise AgentError(
            f"rollout {ctx.rollout}: the default agent scores gsm8k-style rows, and this row's env extras have no "
            "reward_spec.ground_truth; give the rows one, or run your own agent (agent=module.path:function)"
        )
    return str(truth)


async def default_agent(ctx: AgentContext) -> dict[str, Any]:
    """Solve the row's task with a calculator tool; the reward is the gsm8k check of the final answer.

    1. Ask the task with the calculator offered (``tools``).
    2. Run each tool call of the reply and send the results back as ``tool`` messages; repeat while
       the model calls tools, up to :data:`MAX_TOOL_ROUNDS` rounds. When the model's first reply
       makes no tool call, the agent makes one itself (the task's first two numbers, added) and
       sends that call and its result in the conversation: the tiny random model of the offline
       default run practically never writes a ``<tool_call>``, and this way every rollout still
       goes through a tool turn. A model that makes its own calls never meets this.
    3. Ask for the final answer (:data:`FINAL_ANSWER_PROMPT`) and score it with skyrl_gym's gsm8k
       check (``#### N`` against ``reward_spec.ground_truth``).

    At least three chat requests per rollout. Returns ``{"reward", "tool_calls", "model_tool_calls"}``:
    the tool calls run, and how many of them the model made.
    """
    import openai
    from skyrl_gym.envs.gsm8k.utils import compute_score

    truth = _ground_truth(ctx)
    messages: list[Any] = list(ctx.prompt)
    tool_calls = model_tool_calls = 0
    http = openai.DefaultAsyncHttpxClient(verify=_tls())  # openai's defaults, the shared TLS context
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, http_client=http)
    async with client:  # closes ``http`` too
        for round_ in range(MAX_TOOL_ROUNDS):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALCULATOR_TOOL])
            message = reply.choices[0].message
            functions = [c for c in message.tool_calls or [] if c.type == "function"]
            calls = [(c.id, c.function.name, c.function.arguments) for c in functions]
            model_tool_calls += len(calls)
            if not calls and round_ == 0:
                arguments = json.dumps({"expression": _task_expression(ctx.prompt)})
                calls = [(f"call_agent_{ctx.rollout}", "calculator", arguments)]
            if not calls:
                messages.append({"role": "assistant", "content": message.content or ""})
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content or "",
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
                        for i, name, arguments in calls
                    ],
                }
            )
            for call_id, name, arguments in calls:
                messages.append({"role": "tool", "tool_call_id": call_id, "content": _run_tool(name, arguments)})
            tool_calls += len(calls)
        messages.append({"role": "user", "content": FINAL_ANSWER_PROMPT})
        # The same tools again: templates render them at the top, so dropping them would rewrite the whole
        # conversation and start a new branch.
        final = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALCULATOR_TOOL])
    answer = final.choices[0].message.content or ""
    return {
        "reward": float(compute_score(answer, truth)),
        "tool_calls": tool_calls,
        "model_tool_calls": model_tool_calls,
    }
