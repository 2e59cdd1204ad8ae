"""Agents that speak the OpenAI or Anthropic APIs, trained token-exact (issues 28, 35, 45; design rules 19, 23, 27).

Design
======

**The capture endpoint** (:func:`serve_capture`, :class:`CaptureServer`). One OpenAI-compatible HTTP
server per generator (per ``generate()`` call, or one across calls inside
``StructuredAgentGenerator.serving()``), on 127.0.0.1 unless ``agent_endpoint_host`` / ``_url`` say
otherwise, running in the caller's event loop on anyio + h11, so it works under asyncio and trio
alike and adds no server dependency. It serves, under a session's base URL
``http://127.0.0.1:PORT/sessions/<key>/v1``:

Its routes come from one registry of wire APIs (``agents._wire``: one module per API, each turning its
request into the typed conversation of ``agents._conversation`` and a recorded call into its reply,
its stream and its error shape); one handler answers them all:

- ``POST /chat/completions``, ``stream`` true or false. ``n`` must be 1; ``temperature``, ``top_p``,
  ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed`` (and vLLM's ``top_k``, ``min_p``,
  ``repetition_penalty``) are laid over the generator's sampling parameters; every other field that
  would change sampling or the answer (``logprobs=true``, penalties, ``logit_bias``, a forced
  ``tool_choice``, a non-text ``response_format``, an unknown field) is refused with a 400 naming it,
  never silently dropped; fields that cannot change the answer (``user``, ``metadata``, ``store``,
  ``service_tier``, ...) are accepted and ignored. The request's ``model`` is not checked (agents
  hard-code names).
- ``POST /responses``: the OpenAI Responses API (what the Agents SDK's default model calls): ``input``
  items and ``instructions`` become messages, function ``tools`` tools (``strict`` dropped), the
  captured call a ``response`` object or its event stream; ``previous_response_id`` names a stored
  response of the same session (kept until it closes; one made with ``store: false`` is not kept, and
  naming it is OpenAI's 404 "Previous response with id '...' not found."); fields it cannot honour are
  refused with a 400 naming them.
- ``POST /completions``: OpenAI's legacy Completions API, ``prompt`` as text (tokenized as it is) or as
  token ids (taken as they are, never re-tokenized), captured on the same extend-or-branch rule; a
  batch of prompts, ``echo``, ``logprobs`` and ``suffix`` are refused with a 400 naming them.
- ``GET /models``: the served model name.
- ``POST /messages`` and ``/messages/count_tokens``: Anthropic's Messages API, for the official
  ``anthropic`` client whose ``base_url`` is the session's root (``ctx.anthropic_base_url``, the base
  URL without ``/v1``): the same render, the same capture and branches; its errors in Anthropic's
  shape ``{"type": "error", "error": {"type", "message"}}``.

A prompt longer than the model's context is answered in its API's own error, not a 500: OpenAI's 400
with ``code: "context_length_exceeded"``, Anthropic's 400 ``invalid_request_error`` "prompt is too
long: N tokens > M maximum" (which Claude Code compacts on): before any engine call when the endpoint
is told the context length (``serve_capture(context_length=...)``), else from the engine's refusal.

The same routes answer under ``/v1`` with ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``), for
agents that cannot change their base URL's path. A session has a public id (the engine's session id) and a secret key,
its only credential, each 128+ bits from :mod:`secrets`; a request reaches exactly one session.
Every request gets an answer, an OpenAI error body ``{"error": {"message", "type", "param",
"code"}}`` when it fails (4xx with ``x-should-retry: false``): no session named or an unknown key →
404; a key in the URL and another session's as bearer → 403; a session whose rollout has ended → 404
of type ``rollout_ended`` naming the rollout (Anthropic's ``not_found_error`` on the Messages routes,
whose error types are all Anthropic's), a status no agent's client retries (ended sessions are
remembered by key, up to a fixed count); a request in flight when its rollout ends or is cancelled →
499 naming the rollout, and the engine request's task is cancelled; a template that refuses the
messages or a lone surrogate → 400; a fault of the endpoint itself → 500 naming the rollout. A
client that disconnects mid-request cancels its engine request too.

**The session is a scope** (:meth:`CaptureServer.session`, an async context manager): opened when the
rollout starts, closed exactly once when its block exits, on every path (return, error, deadline,
cancellation). Closing cancels the session's in-flight requests (499), waits for them to end (bounded
by ``env_cleanup_timeout_s``), finishes the engine session and drops its state; nothing outlives it
and no timer collects it. When a rollout is cancelled while its agent is blocked in a
worker thread on an HTTP call, the session is closed first, which answers that call, so the thread
returns and the cancellation completes.

**Token-in, token-out** (:class:`Capture`). Each request's messages are rendered with the tokenizer's
chat template (``tools`` passed to it; assistant ``tool_calls`` arguments parsed from their JSON
string) as text. A session keeps *branches*: append-only token sequences. A call reuses the ids up to
the longest recorded call end its render starts with (a call's end: its rendered prompt followed by the
decoded ids the engine sampled, special tokens kept). At a branch's tip the call *extends* the branch;
at an earlier call's end it *forks*: a new branch starts with the ids up to there as they were
recorded (two continuations of one earlier turn, or two requests naming one ``previous_response_id``).
Either way those ids are never re-tokenized, and only the rest of the render (the messages added
since, the generation prompt) is tokenized (loss mask 0). Otherwise (history rewritten, ``<think>``
blocks stripped by the template, a summary, a re-serialised tool call) the call starts a new branch
from the whole render. The engine gets the branch's token ids through the ``InferenceClient``
(``generate({"prompt_token_ids": [ids], "sampling_params": ..., "session_ids": [id]})``); its sampled
ids and logprobs are recorded exactly as returned, and the client is answered with the engine's text.
The comparison is made on text rather than on a re-tokenized render, so a sampled tokenization that is
not the tokenizer's canonical one still extends its branch. Two requests of one session in flight at
once that both extend the same branch cannot both stay on it: the one recorded second forks at the
point it was prepared from.

**Tool calls**: when the request offers ``tools``, Hermes-style ``<tool_call>{"name", "arguments"}
</tool_call>`` blocks of the reply (Qwen2.5 / Qwen3) are returned as OpenAI ``tool_calls`` (ids
``call_<completion id>_<k>``), the text outside them as ``content`` and ``finish_reason="tool_calls"``.

**The generator** (:class:`StructuredAgentGenerator`, SkyRL's ``generate(input_batch) ->
GeneratorOutput``): per prompt, a capture session and the user's ``async agent(ctx)`` (``ctx``:
:class:`AgentContext` with base URL, API key, prompt, env extras); the reward is the returned number
or ``result["reward"]``. :func:`command_agent` makes such an agent of a command line: run per rollout
in its own process group with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (and ``ANTHROPIC_BASE_URL`` /
``ANTHROPIC_API_KEY``) set, its reward the last line of
its stdout, the whole group killed when it exits or its rollout ends. The rollouts run on the gym
generator's supervisor (``_runtime.supervisor.run_rollouts``) and are collected by its collector, so
every guarantee holds for them: each *attempt* is one session and one run of the agent (a retry,
``max_rollout_retries``, starts from scratch in a fresh session; the old one answers 404);
``rollout_timeout_s`` stops while the generator is paused (:meth:`~StructuredAgentGenerator.pause`);
a deadline, a straggler cut (``straggler_cutoff``) or the caller's cancel closes the session, which
answers the agent's in-flight request with 499 and cancels its engine request, and kills a command
agent's process group; failures become placeholders under ``failed_rollout_policy`` and the failure
budget; ``max_concurrent_rollouts`` is one set of slots for all concurrent ``generate()`` calls.
Observers (``generator.observers``) hear the attempt events, ``env_opened`` when the session opens, one
``engine_call_*`` pair per captured call (the session carries its attempt's ``RolloutContext``: its
requests run in the server's tasks, not the rollout's), the session's close as an ``env_close``
cleanup and its ``finish_session`` cleanup: the session is the agent's environment to every count.

Rows: without ``step_wise_trajectories``, a rollout's row is its **main conversation**, whatever order
the calls completed in: the branch of the last call sent with the header ``x-skyrl-branch: main``;
else, leaving out branches whose calls all say ``x-skyrl-branch: side`` and, when some call names the
served model, the branches of calls naming another (a small model's side calls), the branch whose
conversation has the most turns, then the most tokens, then the latest last call. Its prompt
ids = the branch's first prompt; response ids = sampled ids (loss mask 1, logprobs as sampled) with the
rendered tails between calls (loss mask 0, logprob 0.0); per-token rewards with the reward on the last
token; the stop reason of the branch's last call; other branches are counted, not trained on. With
``step_wise_trajectories``, **every branch** is returned as steps, one per captured call: the call's
engine prompt, then what it sampled (mask 1) and the tail rendered before the branch's next call (mask
0), so a branch's steps concatenate back to the branch token for token from its first call on (a
fork's shared ids are in its source's steps); branches come in order, the main branch last, whose last
step carries the reward (``is_last_step``). Counted either way
in ``rollout_metrics``: ``generate/agent_calls``, ``generate/agent_branches``,
``generate/agent_multi_branch_rollouts`` (over the rollouts that succeeded).

**Choosing an agent by name** (:func:`resolve_agent`): a configuration value ``default`` (the
embedded :func:`default_agent`, a calculator-tool loop on the official ``openai`` client),
``module.path:function`` (an agent function: async, or plain and run in a worker thread) or
``command:<command line>`` (:func:`command_agent`), checked when resolved, before any rollout.
``skyrl-structured rollout agent=...`` and SkyRL's ``generator.agent=...`` (``StructuredPPOExp``) both
go through it.

**The check kit**: :func:`check_capture` renders a three-call conversation with a tool turn call by
call and says which calls extend the previous prompt + reply and which would branch, and where.

Streaming: a ``stream: true`` request of any API gets the same answer as that API's events
(``chat.completion.chunk``, the Responses event sequence, ``text_completion`` chunks, Anthropic's
``message_start`` ... ``message_stop``) once the engine's reply is complete: the ``InferenceClient``
returns whole replies, so a reply is streamed once whole, not token by token (see docs/agents.md).
"""

from ..errors import AgentError, CaptureWorkerError
from ._apierrors import APIError
from ._capture import Branch, CallRecord, Capture
from ._check import CallCheck, CaptureCheck, check_capture
from ._command import command_agent
from ._conversation import parse_tool_calls
from ._default import default_agent
from ._generator import AgentContext, AgentFn, StructuredAgentGenerator, SyncAgentFn
from ._select import AGENT_VALUES, check_agent_choice, resolve_agent
from ._serve import serve_capture
from ._server import CaptureServer, CaptureSession

__all__ = [
    "AGENT_VALUES",
    "APIError",
    "AgentContext",
    "AgentError",
    "AgentFn",
    "Branch",
    "CallCheck",
    "CallRecord",
    "Capture",
    "CaptureCheck",
    "CaptureServer",
    "CaptureSession",
    "CaptureWorkerError",
    "StructuredAgentGenerator",
    "SyncAgentFn",
    "check_agent_choice",
    "check_capture",
    "command_agent",
    "default_agent",
    "parse_tool_calls",
    "resolve_agent",
    "serve_capture",
]
