"""The token bookkeeping of one capture session: requests in, engine token ids recorded, branches kept.

Nothing here does I/O: :mod:`._server` parses HTTP and calls :meth:`Capture.prepare` (render the
request, decide extend-or-branch, build the engine's token prompt) and :meth:`Capture.record` (keep
the engine's sampled ids and logprobs), then answers in the wire shape of the request's API
(:mod:`._chat`, :mod:`._responses`, :mod:`._anthropic`: one module each, design rule 23).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "APIError",
    "Branch",
    "CallRecord",
    "CallTag",
    "Capture",
    "Prepared",
    "check_encodable",
    "engine_sampling_params",
    "parse_tool_calls",
    "render_text",
]


class APIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with ``status``.

    A 4xx answer also says ``x-should-retry: false`` (:attr:`headers`), which the official ``openai`` and
    ``anthropic`` clients obey: the same request would get the same answer. So does an answer made
    with ``final=True`` (an engine failure: the engine client has already retried and failed over,
    and the generator's own retry policy decides the rollout's fate; a client retry would send the
    request to the engine twice more).
    """

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str | None = None, final: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _ERROR_TYPES.get(status, "server_error")
        self.final = final or 400 <= status < 500

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        return _FINAL if self.final else ()


_FINAL = (("x-should-retry", "false"),)
_ERROR_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "rollout_cancelled",
    500: "server_error",
}


def _bad(param: str, problem: str) -> APIError:
    return APIError(400, f"`{param}` {problem}", param=param)


# ----------------------------------------------------------------------------- sampling parameters

#: Request fields read elsewhere (messages, tools) or with no effect on the answer (accepted and ignored: a
#: billing tier, a cache or abuse key, storage and tagging on OpenAI's side): accepted as they are.
_NOT_SAMPLING = frozenset(
    {
        "model",
        "messages",
        "tools",
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)
#: OpenAI (and vLLM extension) fields mapped onto SkyRL's sampling parameters of the same name.
_NUMBERS = {"temperature": 0.0, "top_p": 0.0, "min_p": 0.0, "repetition_penalty": 0.0}
#: Fields accepted only at their neutral value: anything else cannot be honoured and is refused.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "stream": (None, False, True),
    "tool_choice": (None, "auto"),
    "n": (None, 1),
    # What the Responses route accepts in `reasoning.effort` and `text.verbosity` (see ._responses._SETTINGS):
    # no reasoning asked for, and OpenAI's default verbosity or the Agents SDK's default ("low", ignored).
    "reasoning_effort": (None, "none"),
    "verbosity": (None, "medium", "low"),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def engine_sampling_params(body: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """The engine's ``sampling_params`` for one chat request: ``base`` overlaid with the request's fields.

    ``base`` is the generator's sampling parameters (SkyRL's vocabulary, as the gym generator sends
    them); ``logprobs`` defaults to 1 so that every sampled token's logprob is recorded. Mapped:
    ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens`` (onto ``max_tokens`` or
    ``max_generate_length``, whichever ``base`` uses), ``stop``, ``seed`` and vLLM's ``top_k``,
    ``min_p``, ``repetition_penalty``. ``stream`` and ``stream_options.include_usage`` shape the
    answer, not the sampling.

    Accepted and ignored (no effect on the answer): ``user``, ``metadata``, ``store``,
    ``parallel_tool_calls``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, and
    ``modalities`` when it asks for text only.

    Raises:
        APIError: 400 naming the first field that cannot be honoured (a non-neutral penalty,
            ``n > 1``, ``logprobs=true``, a forced ``tool_choice``, a ``reasoning_effort`` other than
            "none", ``verbosity`` "high", a
            ``response_format`` other than text, a ``logit_bias``, audio ``modalities``, an unknown
            field) or has a bad value.
    """
    params = dict(base or {})
    params.setdefault("logprobs", 1)
    limits = (body.get("max_tokens"), body.get("max_completion_tokens"))
    if None not in limits and limits[0] != limits[1]:
        raise _bad(
            "max_completion_tokens", f"= {limits[1]!r} disagrees with `max_tokens` = {limits[0]!r}; send only one"
        )
    for key, value in body.items():
        if key in _NOT_SAMPLING:
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key] or (isinstance(value, bool) and key not in ("stream", "logprobs")):
                # (True == 1 and False == 0 in Python: a boolean `n` or penalty is refused explicitly)
                raise _bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
        elif key in _NUMBERS:
            if value is None:
                continue
            if not _is_number(value) or value < _NUMBERS[key]:
                raise _bad(key, f"must be a number >= {_NUMBERS[key]:g}, got {value!r}")
            params[key] = value
        elif key in ("max_tokens", "max_completion_tokens"):
            if value is None:
                continue
            if type(value) is not int or value < 1:
                raise _bad(key, f"must be an integer >= 1, got {value!r}")
            params["max_tokens" if "max_tokens" in params else "max_generate_length"] = value
        elif key == "top_k":
            if value is None:
                continue
            if type(value) is not int:
                raise _bad(key, f"must be an integer (-1 or 0 disables it), got {value!r}")
            params[key] = value
        elif key == "seed":
            if value is None:
                continue
            if type(value) is not int:
                raise _bad(key, f"must be an integer, got {value!r}")
            params[key] = value
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if stops is None:
                continue
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise _bad(key, f"must be a string or a list of strings, got {value!r}")
            params[key] = list(stops)
        elif key == "stream_options":
            if value is None:
                continue
            if not body.get("stream"):
                raise _bad(key, "is only allowed with `stream=true`")
            if not isinstance(value, dict) or set(value) - {"include_usage"}:
                raise _bad(key, f"= {value!r}: only `include_usage` is supported")
        elif key == "logit_bias":
            if value:
                raise _bad(key, "cannot be honoured by this capture endpoint; leave it unset")
        elif key == "modalities":
            if value is not None and (not isinstance(value, list) or set(value) - {"text"}):
                raise _bad(key, f'= {value!r}: only text can be captured; leave it unset or send ["text"]')
        elif key == "response_format":
            if value is not None and value != {"type": "text"}:
                raise _bad(key, f"= {value!r} cannot be honoured by this capture endpoint; leave it unset")
        else:
            raise _bad(key, "is not supported by this capture endpoint; remove it from the request")
    return params


# ----------------------------------------------------------------------------- messages and rendering


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, ``None`` (empty) or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(where, "holds a content part that is not text; only text parts can be captured")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(where, f"must be a string, null or a list of text parts, got {type(content).__name__}")


def _template_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as a chat template expects them.

    Content becomes text; an assistant's ``tool_calls[*].function.arguments`` (a JSON string on the
    wire) becomes the dict Hugging Face chat templates serialise.
    """
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of chat messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a string `role`")
        converted = dict(message)
        converted["content"] = _content_text(message.get("content"), f"messages[{i}].content")
        calls = message.get("tool_calls")
        if calls:
            converted["tool_calls"] = [
                _template_tool_call(call, f"messages[{i}].tool_calls[{k}]") for k, call in enumerate(calls)
            ]
        out.append(converted)
    return out


def _template_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(where, "must be an object with `function.name`")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise _bad(f"{where}.function.arguments", f"is not valid JSON ({exc.msg})") from None
    converted = dict(call)
    converted["function"] = {"name": function["name"], "arguments": arguments}
    return converted


#: A JSON escape of a UTF-16 surrogate: the only way a request's text can hold one (raw surrogate bytes are not
#: UTF-8, and the body would not decode). A paired one decodes to one character; a lone one cannot be encoded.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_encodable(value: Any, where: str = "") -> None:
    """Refuse a request whose text holds a lone UTF-16 surrogate (``"\\udce9"``): no tokenizer can encode it.

    Raises:
        APIError: 400 naming the first field holding one, e.g. ``messages[2].content``.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _bad(
                where or "body", f"holds a lone UTF-16 surrogate ({value[exc.start]!r}) that no text can encode"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_encodable(key, where)
            check_encodable(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_encodable(item, f"{where}[{index}]")


def render_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, **kwargs: Any) -> str:
    """The chat template's text for ``messages`` (with the generation prompt), ``tools`` passed to it."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
    )
    if not isinstance(text, str):
        raise TypeError(f"the tokenizer's apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


# ----------------------------------------------------------------------------- tool calls

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, *, id_prefix: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks as OpenAI ``tool_calls``.

    Returns ``(content, tool_calls)``: the text outside the blocks (stripped; None when empty and
    there are calls) and one call per block, ids ``{id_prefix}_{k}``. A block that is not JSON with
    a string ``name`` leaves the whole reply as plain content, with no calls.
    """
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(blocks):
        try:
            parsed = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return text, []
        arguments = parsed.get("arguments", {})
        calls.append(
            {
                "id": f"{id_prefix}_{k}",
                "type": "function",
                "function": {
                    "name": parsed["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


# ----------------------------------------------------------------------------- branches


@dataclass(frozen=True)
class CallTag:
    """What a request says about the conversation it belongs to; the rollout's row is chosen with it.

    ``mark`` is the request's ``x-skyrl-branch`` header (``"main"``, ``"side"`` or None); ``served``
    says whether its ``model`` names the model the endpoint serves (:mod:`._rows` reads both).
    """

    mark: str | None = None
    served: bool = False


@dataclass
class Branch:
    """One append-only token sequence: a prompt, then sampled tokens (mask 1) and rendered tails (mask 0)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Whether every sampled token came with a logprob (False once a reply lacked them).
    has_logprobs: bool = True
    #: The text these ids stand for: what a later render must start with to extend this branch.
    text: str = ""
    stop_reason: str = "stop"
    calls: int = 0
    #: Where each call recorded on this branch ended: ``(characters of text, ids)``, ascending. A later call
    #: may fork from any of these points, reusing the ids up to there (design rule 19).
    ends: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        """How many ids the branch holds: its prompt and response ids."""
        return len(self.prompt_ids) + len(self.response_ids)

    def prefix(self, length: int) -> Branch:
        """A new branch holding this one's first ``length`` ids as they are (masks and logprobs too)."""
        cut = length - len(self.prompt_ids)
        return Branch(
            prompt_ids=list(self.prompt_ids),
            response_ids=self.response_ids[:cut],
            loss_mask=self.loss_mask[:cut],
            logprobs=self.logprobs[:cut],
            has_logprobs=self.has_logprobs,
        )


@dataclass
class CallRecord:
    """One captured chat completion: what the engine got and what it sampled, exactly."""

    branch: int
    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float] | None
    stop_reason: str
    text: str
    #: Whether this call extended its branch (False: it started the branch, afresh or as a fork).
    extended: bool
    #: How many leading prompt ids were earlier calls' ids reused as recorded (0: the whole prompt was rendered).
    reused: int = 0
    #: The conversation's turns with this call: the request's assistant messages, plus this call's reply.
    turns: int = 1
    tag: CallTag = CallTag()


@dataclass
class Prepared:
    """A request ready for the engine: its branch, the full token prompt, the tail rendered for it."""

    branch: int
    prompt_ids: list[int]
    tail_ids: list[int]
    rendered: str
    #: Whether the call extends ``branch`` from its tip.
    extended: bool
    #: How many of ``branch``'s ids the prompt reuses (its length when extended; 0 when nothing is reused).
    base_length: int = 0
    #: Whether the call forks from ``branch``: reuses its first ``base_length`` ids (an earlier call's end,
    #: not the tip) in a new branch.
    fork: bool = False
    turns: int = 1
    tag: CallTag = CallTag()


class Capture:
    """The branches and calls of one session; the extend-or-branch rule lives here.

    A call reuses the ids of the longest recorded point its rendered text starts with: a point is
    where a recorded call ended (its prompt's render followed by the decoded sampled ids). At a
    branch's tip the call extends the branch; at an earlier call's end it forks: a new branch starts
    with the ids up to there, as they were recorded (two continuations of one earlier turn never
    re-tokenize what the engine sampled, design rule 19). Either way only the rest of the render
    (the new messages, the generation prompt) is tokenized, loss mask 0. With no such point the call
    starts a new branch from the whole render. An agent that interleaves two conversations in one
    session keeps two branches, each extended in turn.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.branches: list[Branch] = []
        self.calls: list[CallRecord] = []

    def prepare(self, body: dict[str, Any], tag: CallTag | None = None) -> Prepared:
        """Render the request and decide which branch it belongs to; nothing is recorded yet.

        ``tag`` is what the request says about its conversation (kept on the call for the row choice).

        Raises:
            APIError: 400 for malformed ``messages`` or ``tools``, or messages the chat template refuses
                (its ``raise_exception``: a role order it does not take), quoting the template's message.
        """
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _bad("tools", "must be a list of tool definitions")
        messages = _template_messages(body.get("messages"))
        from jinja2 import TemplateError  # what a template's raise_exception raises (transformers' chat templates)

        try:
            rendered = render_text(self.tokenizer, messages, tools, **self.chat_template_kwargs)
        except TemplateError as exc:
            raise APIError(
                400, f"the model's chat template refused these messages: {exc.message or exc}", param="messages"
            ) from None
        turns = 1 + sum(message["role"] == "assistant" for message in messages)
        tag = tag or CallTag()
        point = self._reusable(rendered)
        if point is None:
            return Prepared(
                len(self.branches), encode(self.tokenizer, rendered), [], rendered, False, turns=turns, tag=tag
            )
        index, chars, length = point
        branch = self.branches[index]
        tail = encode(self.tokenizer, rendered[chars:])
        base = branch.prompt_ids + branch.response_ids[: length - len(branch.prompt_ids)]
        tip = length == branch.length
        return Prepared(index, base + tail, tail, rendered, tip, length, fork=not tip, turns=turns, tag=tag)

    def _reusable(self, rendered: str) -> tuple[int, int, int] | None:
        """The longest recorded point ``rendered`` starts with: ``(branch, characters, ids)``, or None.

        On equal length a branch's tip wins over an earlier call's end (extend rather than fork), then the
        latest branch (usually the one extended).
        """
        best: tuple[int, int, int] | None = None
        best_key = (0, False)
        for index in range(len(self.branches) - 1, -1, -1):
            branch = self.branches[index]
            if rendered.startswith(branch.text):
                point, tip = (len(branch.text), branch.length), True
            else:
                found = _last_end_within(branch, rendered)
                if found is None:
                    continue
                point, tip = found, False
            if (point[0], tip) > best_key:
                best, best_key = (index, *point), (point[0], tip)
        return best

    def record(
        self, prepared: Prepared, sampled_ids: list[int], logprobs: list[float] | None, stop_reason: str, text: str
    ) -> CallRecord:
        """Keep the engine's sampled ids and logprobs on the prepared call's branch, exactly as returned.

        A fork starts a new branch with the reused ids as they were recorded (their masks and logprobs).
        A call prepared to extend a branch that another call of the session extended meanwhile
        (concurrent requests) no longer extends it: it forks at the point it was prepared from, so no
        branch ever holds ids the engine did not see in that order.
        """
        index = prepared.branch
        extended = False
        if prepared.extended or prepared.fork:
            source = self.branches[index]
            if prepared.extended and source.length == prepared.base_length:
                branch, extended = source, True
            else:
                branch, index = source.prefix(prepared.base_length), len(self.branches)
                self.branches.append(branch)
            branch.response_ids += prepared.tail_ids
            branch.loss_mask += [0] * len(prepared.tail_ids)
            branch.logprobs += [0.0] * len(prepared.tail_ids)
        else:
            branch, index = Branch(prompt_ids=list(prepared.prompt_ids)), len(self.branches)
            self.branches.append(branch)
        branch.response_ids += sampled_ids
        branch.loss_mask += [1] * len(sampled_ids)
        branch.logprobs += logprobs if logprobs is not None else [0.0] * len(sampled_ids)
        branch.has_logprobs = branch.has_logprobs and logprobs is not None
        branch.text = prepared.rendered + decode(self.tokenizer, sampled_ids)
        branch.ends.append((len(branch.text), branch.length))
        branch.stop_reason = stop_reason
        branch.calls += 1
        call = CallRecord(
            index,
            list(prepared.prompt_ids),
            list(sampled_ids),
            logprobs,
            stop_reason,
            text,
            extended,
            reused=prepared.base_length if prepared.extended or prepared.fork else 0,
            turns=prepared.turns,
            tag=prepared.tag,
        )
        self.calls.append(call)
        return call


def _last_end_within(branch: Branch, rendered: str) -> tuple[int, int] | None:
    """The last of ``branch``'s call ends that ``rendered`` starts with, ``(characters, ids)``, or None.

    Matching is monotone along a branch (its text only grows), so the ends are searched by bisection.
    """
    low, high = 0, len(branch.ends)  # invariant: ends[:low] match, ends[high:] do not
    while low < high:
        middle = (low + high) // 2
        if rendered.startswith(branch.text[: branch.ends[middle][0]]):
            low = middle + 1
        else:
            high = middle
    return branch.ends[low - 1] if low else None
