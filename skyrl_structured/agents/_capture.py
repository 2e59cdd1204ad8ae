"""The token bookkeeping of one capture session: token ids recorded, branches kept (design rules 19, 23, 27).

Nothing here parses a request or does I/O: a wire API (:mod:`._wire`) turns its request into a
rendered prompt (or token ids), :meth:`Capture.prepare` / :meth:`Capture.prepare_ids` decide
extend-or-branch and build the engine's token prompt, and :meth:`Capture.record` keeps the engine's
sampled ids and logprobs exactly as returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ._conversation import decode, encode

__all__ = ["Branch", "CallRecord", "CallTag", "Capture", "Prepared", "capture_state", "restore_capture"]


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

    def prepare(self, rendered: str, *, turns: int = 1, tag: CallTag | None = None) -> Prepared:
        """Decide which branch a rendered prompt belongs to and build its token prompt; nothing is recorded yet.

        ``turns`` counts the request's assistant messages plus this call's reply; ``tag`` is what the request
        says about its conversation (both kept on the call for the row choice, :mod:`._rows`).
        """
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

    def prepare_ids(self, prompt_ids: Sequence[int], *, turns: int = 1, tag: CallTag | None = None) -> Prepared:
        """The same rule for a prompt sent as token ids (legacy completions): taken as they are, never re-tokenized.

        The prompt reuses the longest recorded point its ids start with (a branch's tip first on equal
        length, then the latest branch); the rest is the tail.
        """
        ids = list(prompt_ids)
        tag = tag or CallTag()
        best: tuple[int, int, int] | None = None  # (branch, characters, ids)
        best_key = (0, False)
        for index in range(len(self.branches) - 1, -1, -1):
            branch = self.branches[index]
            held = branch.prompt_ids + branch.response_ids
            for chars, length in reversed(branch.ends):
                key = (length, length == branch.length)
                if key > best_key and ids[:length] == held[:length]:
                    best, best_key = (index, chars, length), key
                    break
        if best is None:
            return Prepared(len(self.branches), ids, [], decode(self.tokenizer, ids), False, turns=turns, tag=tag)
        index, chars, length = best
        branch = self.branches[index]
        tail = ids[length:]
        rendered = branch.text[:chars] + decode(self.tokenizer, tail)
        tip = length == branch.length
        return Prepared(index, ids, tail, rendered, tip, length, fork=not tip, turns=turns, tag=tag)

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


def capture_state(capture: Capture) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What a capture recorded, as plain data (branches, calls): what an endpoint worker sends the trainer."""
    return [dataclasses.asdict(b) for b in capture.branches], [dataclasses.asdict(c) for c in capture.calls]


def restore_capture(capture: Capture, state: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> None:
    """Make ``capture`` hold what :func:`capture_state` took: the same branches and calls, field by field."""
    branches, calls = state
    capture.branches = [Branch(**{**b, "ends": [tuple(e) for e in b["ends"]]}) for b in branches]
    capture.calls = [CallRecord(**{**c, "tag": CallTag(**c["tag"])}) for c in calls]
