"""``max_concurrent_rollouts="auto"``'s committed context on its own: admitted attempts and their contexts."""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_structured._runtime.committed import CommittedContexts, committed_tokens


@dataclass(eq=True)
class Attempt:
    """Stands for a ``RolloutContext`` (equal when their tokens are: the set must go by identity)."""

    engine_context_tokens: int | None = None


def test_an_attempt_counts_its_latest_context_from_admission_to_release():
    call = CommittedContexts()
    first, second = Attempt(), Attempt()
    call.admit(first)
    call.admit(second)
    first.engine_context_tokens = 100
    second.engine_context_tokens = 300
    assert (call.tally(), len(call)) == ((400, 2, 0), 2)
    first.engine_context_tokens = 160  # its next call
    assert call.tally() == (460, 2, 0)
    call.release(first)
    assert (call.tally(), list(call)) == ((300, 1, 0), [second])
    call.release(first)  # twice: nothing
    call.release(second)
    assert (call.tally(), len(call)) == ((0, 0, 0), 0)


def test_equal_attempts_are_still_two():
    call = CommittedContexts()
    one, other = Attempt(50), Attempt(50)
    call.admit(one)
    call.admit(other)
    call.release(one)
    assert list(call) == [other]
    assert next(iter(call)) is other


def test_an_attempt_without_a_call_counts_as_the_mean_of_the_others_over_every_call():
    a, b = CommittedContexts(), CommittedContexts()
    a.admit(Attempt(100))
    a.admit(Attempt())
    b.admit(Attempt(300))
    b.admit(Attempt())
    b.admit(Attempt())
    # 400 measured over 2 attempts: the 3 without a call count 200 each.
    assert committed_tokens([a, b]) == 1000.0


def test_nothing_admitted_is_zero_and_nothing_measured_is_unknown():
    assert committed_tokens([]) == 0.0
    assert committed_tokens([CommittedContexts()]) == 0.0
    waiting = CommittedContexts()
    waiting.admit(Attempt())
    assert committed_tokens([waiting]) is None
    assert committed_tokens([waiting, CommittedContexts()]) is None
