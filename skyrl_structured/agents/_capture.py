"""The token bookkeeping of one capture session: token ids recorded, branches kept (design rules 19, 23, 27).

Nothing here parses a request or does I/O: a wire API (:mod:`._wire`) turns its request into a
rendered prompt (or token ids), :meth:`Capture.prepare` / :meth:`Capture.prepare_ids` decide
extend-or-branch and build the engine's token prompt, and :meth:`Capture.record` keeps the engine's
sampled ids and logprobs exactly as returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ._conversation import decode, encode

__all__ = ["Branch", "CallRecord", "Capture", "Prepared"]


# ----------------------------------------------------------------------------- branches


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


@dataclass
class CallRecord:
    """One captured chat completion: what the engine got and what it sampled, exactly."""

    branch: int
    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float] | None
    stop_reason: str
    text: str
    #: Whether this call extended its branch (False: it started the branch).
    extended: bool


@dataclass
class Prepared:
    """A request ready for the engine: its branch, the full token prompt, the tail rendered for it."""

    branch: int
    prompt_ids: list[int]
    tail_ids: list[int]
    rendered: str
    extended: bool
    #: The branch's length (prompt + response ids) when this call was prepared from it.
    base_length: int = 0


class Capture:
    """The branches and calls of one session; the extend-or-branch rule lives here.

    A call extends a branch when its rendered text starts with the branch's text (its last prompt's
    render followed by the decoded sampled ids; the latest branch is tried first): the branch's ids
    are reused as they are and only the rest of the render (the new messages, the generation prompt)
    is tokenized, loss mask 0. Otherwise the call starts a new branch from the whole render. An agent
    that interleaves two conversations in one session keeps two branches, each extended in turn.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.branches: list[Branch] = []
        self.calls: list[CallRecord] = []

    def prepare(self, rendered: str) -> Prepared:
        """Decide which branch a rendered prompt belongs to and build its token prompt; nothing is recorded yet."""
        for index in range(len(self.branches) - 1, -1, -1):  # the latest first: usually the one extended
            branch = self.branches[index]
            if rendered.startswith(branch.text):
                tail = encode(self.tokenizer, rendered[len(branch.text) :])
                base = branch.prompt_ids + branch.response_ids
                return Prepared(index, base + tail, tail, rendered, True, len(base))
        return Prepared(len(self.branches), encode(self.tokenizer, rendered), [], rendered, False)

    def prepare_ids(self, prompt_ids: Sequence[int]) -> Prepared:
        """The same rule for a prompt sent as token ids (legacy completions): taken as they are, never re-tokenized.

        It extends a branch (the latest first) when it starts with the branch's ids; the rest is the tail.
        """
        ids = list(prompt_ids)
        for index in range(len(self.branches) - 1, -1, -1):
            branch = self.branches[index]
            base = branch.prompt_ids + branch.response_ids
            if ids[: len(base)] == base:
                tail = ids[len(base) :]
                return Prepared(index, ids, tail, branch.text + decode(self.tokenizer, tail), True, len(base))
        return Prepared(len(self.branches), ids, [], decode(self.tokenizer, ids), False)

    def record(
        self, prepared: Prepared, sampled_ids: list[int], logprobs: list[float] | None, stop_reason: str, text: str
    ) -> CallRecord:
        """Keep the engine's sampled ids and logprobs on the prepared call's branch, exactly as returned.

        A call prepared to extend a branch that another call of the session extended meanwhile
        (concurrent requests) no longer extends it: it is recorded as a new branch from the prompt
        it was actually sent with, so no branch ever holds ids the engine did not see in that order.
        """
        index = prepared.branch
        branch = self.branches[index] if prepared.extended else None
        if branch is not None and len(branch.prompt_ids) + len(branch.response_ids) == prepared.base_length:
            branch.response_ids += prepared.tail_ids
            branch.loss_mask += [0] * len(prepared.tail_ids)
            branch.logprobs += [0.0] * len(prepared.tail_ids)
        else:
            branch = Branch(prompt_ids=list(prepared.prompt_ids))
            index = len(self.branches)
            self.branches.append(branch)
            prepared = Prepared(index, prepared.prompt_ids, [], prepared.rendered, False)
        branch.response_ids += sampled_ids
        branch.loss_mask += [1] * len(sampled_ids)
        branch.logprobs += logprobs if logprobs is not None else [0.0] * len(sampled_ids)
        branch.has_logprobs = branch.has_logprobs and logprobs is not None
        branch.text = prepared.rendered + decode(self.tokenizer, sampled_ids)
        branch.stop_reason = stop_reason
        branch.calls += 1
        call = CallRecord(
            prepared.branch,
            list(prepared.prompt_ids),
            list(sampled_ids),
            logprobs,
            stop_reason,
            text,
            prepared.extended,
        )
        self.calls.append(call)
        return call
