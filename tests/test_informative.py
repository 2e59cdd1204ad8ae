"""``InformativeBatches``: batches of informative GRPO groups without waiting for whole batches.

Each call starts more groups than it needs, stops once enough are final with a reward spread (the
others are cut: parked with carry-over), drops the groups whose samples all scored the same (as
SkyRL's ``dynamic_sampling.type=filter`` does) and carries every unfinished group into the next
call, its finished samples kept and its parked ones resumed. Graded by skyrl_gym's real ``gsm8k``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import anyio
import pytest

from skyrl_structured import InformativeBatches, PromptGroup
from skyrl_structured.engines.partial import offer_partial
from skyrl_structured.observe import RolloutObserver, RolloutRef
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine

from .helpers import make_generator

pytestmark = pytest.mark.anyio

CARRY: dict[str, Any] = {
    "skip_failed_rollouts": True,
    "failure_budget_action": "warn",
    "carry_over_cut_rollouts": True,
    "straggler_cutoff": 1.0,  # the share cutoff cuts nothing: only a call's stop does
    "max_turns": 1,
}
HEAD = 2


def group(k: int) -> PromptGroup:
    return PromptGroup(
        uid=f"g{k}",
        prompt=[{"role": "user", "content": f"What is {k} + 3?"}],
        env_class="gsm8k",
        env_extras={"reward_spec": {"method": "rule", "ground_truth": str(k + 3)}},
    )


class Graders(RolloutObserver):
    """The engine: sample 0 of an informative group answers right and sample 1 wrong; both samples of an
    uninformative group answer right. ``hung`` sessions hang on their first request after offering its first
    ``HEAD`` tokens; every other request waits until the hung ones are in the engine. The requests of the
    ``last`` groups wait, besides, until every rollout in ``first`` has finished (heard as an observer): which
    rollouts are still running when a call stops is then the script's, never the scheduler's."""

    def __init__(
        self,
        tokenizer: Any,
        uninformative: set[str],
        hung: set[str],
        last: Collection[str] = (),
        first: Collection[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.uninformative = uninformative
        self.hung = set(hung)
        self.entered: set[Any] = set()
        self.hung_in = anyio.Event()
        if not hung:
            self.hung_in.set()
        self.continued: list[str] = []
        self.last = set(last)
        self.first = set(first)
        self.first_done = anyio.Event()
        if not first:
            self.first_done.set()

    def rollout_finished(self, rollout: RolloutRef, *, failed: bool) -> None:
        """The observer event: a rollout of ``first`` has finished (its session id is ``<uid>_<repetition>``)."""
        tid = rollout.trajectory_id
        if tid is not None:
            self.first.discard(f"{tid.instance_id}_{tid.repetition_id}")
            if not self.first:
                self.first_done.set()

    def reply_ids(self, session: str) -> list[int]:
        uid, repetition = session.rsplit("_", 1)
        k = int(uid[1:])
        right = uid in self.uninformative or repetition == "0"
        text = f"The answer is #### {k + 3 if right else k + 4}"
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]

    async def __call__(self, call: EngineCall) -> Reply:
        session = str(call.session_id)
        self.entered.add(session)
        if self.hung <= self.entered:
            self.hung_in.set()
        ids = self.reply_ids(session)
        if call.prompt_token_ids[-HEAD:] == ids[:HEAD]:  # a parked request continued
            self.continued.append(session)
            return Reply(self.tokenizer.decode(ids[HEAD:], skip_special_tokens=True), token_ids=ids[HEAD:])
        if session in self.hung:
            self.hung.discard(session)
            offer_partial(ids[:HEAD], None, self.tokenizer.decode(ids[:HEAD], skip_special_tokens=True))
            await anyio.sleep_forever()
        await self.hung_in.wait()
        if session.rsplit("_", 1)[0] in self.last:
            await self.first_done.wait()
        return Reply(self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids)


def groups_of(uids: list[str]) -> list[str]:
    """The batch's groups in order, asserting each group's two samples are side by side."""
    pairs = [uids[i : i + 2] for i in range(0, len(uids), 2)]
    assert all(a == b for a, b in pairs), uids
    return [a for a, _ in pairs]


async def test_a_call_stops_at_the_groups_it_needs_and_carries_the_rest(tokenizer: Any) -> None:
    # g0 and g3 answer only once g1_0 and g2 have finished: the call's stop then finds only g1_1 running.
    graders = Graders(
        tokenizer, uninformative={"g2", "g5"}, hung={"g1_1"}, last={"g0", "g3"}, first={"g1_0", "g2_0", "g2_1"}
    )
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, graders, logprobs=False), **CARRY)
    gen.observers = [graders]
    batches = InformativeBatches(gen, n_samples_per_prompt=2, oversample=1.0)
    batches.add(group(k) for k in range(6))

    first = await batches.next(2)
    # Four groups started (2 x (1 + 1.0)); g0 and g3 informative, g2 dropped, g1 carried (its sample 1 parked).
    assert first.started == 4
    assert sorted(groups_of(first.uids)) == ["g0", "g3"]
    assert first.groups == 2
    assert first.dropped == 1
    assert first.carried == 3  # g1, then g4 and g5 (never started)
    assert gen.parked_rollouts == 1
    rewards = [sum(r) for r in first.output["rewards"]]  # type: ignore[arg-type]
    assert rewards == [1.0, 0.0, 1.0, 0.0]  # each group: the right answer, then the wrong one
    assert len(first.output["response_ids"]) == 4
    assert (first.output["rollout_metrics"] or {})["generate/informative/dropped_groups"] == 1.0

    second = await batches.next(2)
    assert sorted(groups_of(second.uids)) == ["g1", "g4"]
    assert graders.continued == ["g1_1"]  # resumed from its partial reply, not sampled again
    assert second.dropped + batches.pending == 1  # g5: uninformative, dropped, or cut before it was final
    g1 = groups_of(second.uids).index("g1")
    assert second.output["response_ids"][2 * g1 + 1] == graders.reply_ids("g1_1")
    assert [sum(r) for r in second.output["rewards"][2 * g1 : 2 * g1 + 2]] == [1.0, 0.0]  # type: ignore[arg-type]
    await gen.aclose()
    assert gen.parked_rollouts == 0


async def test_fewer_groups_come_back_when_the_waiting_ones_run_out(tokenizer: Any) -> None:
    graders = Graders(tokenizer, uninformative={"g1"}, hung=set())
    gen = make_generator(tokenizer, ScriptedEngine(tokenizer, graders, logprobs=False), **CARRY)
    batches = InformativeBatches(gen, n_samples_per_prompt=2, oversample=0.5)
    batches.add(group(k) for k in range(2))
    batch = await batches.next(4)
    assert groups_of(batch.uids) == ["g0"]
    assert batch.dropped == 1
    assert batches.pending == 0
    empty = await batches.next(1)
    assert empty.groups == 0
    assert empty.output["response_ids"] == []


async def test_bad_arguments_are_refused_in_one_line(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"carry_over_cut_rollouts=true"):
        InformativeBatches(make_generator(tokenizer), n_samples_per_prompt=2)
    gen = make_generator(tokenizer, **CARRY)
    with pytest.raises(ValueError, match=r"`oversample` must be"):
        InformativeBatches(gen, n_samples_per_prompt=2, oversample=-1)
    with pytest.raises(ValueError, match=r"`n_samples_per_prompt` must be"):
        InformativeBatches(gen, n_samples_per_prompt=0)
    with pytest.raises(ValueError, match=r"`needed` must be"):
        await InformativeBatches(gen, n_samples_per_prompt=2).next(0)
