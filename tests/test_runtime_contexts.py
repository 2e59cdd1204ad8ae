"""What a call and each rollout attempt carry, on their own: ``BatchContext``, ``RolloutContext``, ``activate``.

What the layers above rely on: inside ``with activate(context):`` (the supervisor's, around each
attempt) ``current_rollout(generator)`` finds that attempt, in the tasks it starts too, and never
in another generator's rollout or a concurrent sibling's; outside, it makes a standalone one from
the generator. With ``generator.sampling_seed`` each request's seed is a function of what the
request is (prompt, sample, turn, batch scope), not of the attempt, and a seed the caller set wins.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from skyrl_structured import TrajectoryID
from skyrl_structured._runtime.contexts import (
    BatchContext,
    RolloutContext,
    activate,
    current_rollout,
    engine_sampling_params,
    request_seed,
    sampling_params_dict,
    seed_scope,
)
from skyrl_structured.config import SamplingParams
from skyrl_structured.generator import StructuredGymGenerator
from skyrl_structured.observe import CleanupKind, Observers, RolloutObserver, RolloutRef

from .helpers import make_generator

#: A bound only a hang reaches.
GENEROUS_S = 60.0


def attempt(
    generator: StructuredGymGenerator,
    *,
    index: int = 0,
    attempt: int = 1,
    trajectory_id: TrajectoryID | None = None,
    sampling_seed: int | None = None,
    scope: str = "",
    observers: Observers | None = None,
) -> RolloutContext:
    batch = BatchContext(
        generator=generator,
        client=generator.inference_engine_client,
        default_params=sampling_params_dict(generator.generator_cfg.sampling_params),
        observers=observers if observers is not None else Observers(),
        sampling_seed=sampling_seed,
        seed_scope=scope,
    )
    return RolloutContext(batch, RolloutRef(index=index, attempt=attempt, trajectory_id=trajectory_id))


# ------------------------------------------------------------------------------ finding the attempt


@pytest.mark.anyio
async def test_inside_activate_the_generator_finds_its_attempt_also_in_the_tasks_it_starts(tokenizer, anyio_backend):
    gen = make_generator(tokenizer)
    context = attempt(gen, index=3, attempt=2)
    found: list[RolloutContext] = []

    async def child() -> None:
        found.append(current_rollout(gen))

    with activate(context):
        assert current_rollout(gen) is context
        async with anyio.create_task_group() as group:
            group.start_soon(child)
    assert found == [context]
    outside = current_rollout(gen)
    assert outside is not context  # after the block: a standalone attempt again
    assert outside.ref == RolloutRef(index=0, attempt=1, trajectory_id=None)


def test_an_attempt_never_leaks_into_another_generators_rollout(tokenizer):
    gen, other = make_generator(tokenizer), make_generator(tokenizer)
    context = attempt(gen)
    with activate(context):
        found = current_rollout(other)
    assert found is not context
    assert found.batch.generator is other
    assert found.client is other.inference_engine_client


@pytest.mark.anyio
async def test_concurrent_attempts_each_find_their_own(tokenizer, anyio_backend):
    gen = make_generator(tokenizer)
    first, second = attempt(gen, index=0), attempt(gen, index=1)
    first_in, second_in, first_out = anyio.Event(), anyio.Event(), anyio.Event()
    found: dict[str, RolloutContext] = {}

    async def run_first() -> None:
        with activate(first):
            first_in.set()
            await second_in.wait()  # the sibling has activated its own meanwhile
            found["first"] = current_rollout(gen)
        first_out.set()

    async def run_second() -> None:
        await first_in.wait()
        with activate(second):
            second_in.set()
            await first_out.wait()  # the sibling has left its block meanwhile
            found["second"] = current_rollout(gen)

    with anyio.fail_after(GENEROUS_S):
        async with anyio.create_task_group() as group:
            group.start_soon(run_first)
            group.start_soon(run_second)
    assert found == {"first": first, "second": second}


def test_activate_restores_the_outer_attempt_and_lets_an_error_through_unchanged(tokenizer):
    gen = make_generator(tokenizer)
    outer, inner = attempt(gen, index=0), attempt(gen, index=1)
    error = ValueError("raised inside the block")
    seen: list[RolloutContext] = []

    def inside_inner() -> None:
        with activate(inner):
            seen.append(current_rollout(gen))
            raise error

    with activate(outer):
        with pytest.raises(ValueError, match="raised inside the block") as caught:
            inside_inner()
        assert caught.value is error
        assert seen == [inner]
        assert current_rollout(gen) is outer
    assert current_rollout(gen) not in (outer, inner)


def test_a_standalone_attempt_is_made_from_the_generator(tokenizer):
    gen = make_generator(tokenizer, sampling_seed=11, sampling_params=SamplingParams(temperature=0.5, top_k=20))
    trajectory_id = TrajectoryID("q7", 1)
    context = current_rollout(gen, trajectory_id)
    assert context.batch.generator is gen
    assert context.client is gen.inference_engine_client
    assert context.batch.default_params == dataclasses.asdict(gen.generator_cfg.sampling_params)
    assert context.batch.sampling_seed == 11
    assert context.ref == RolloutRef(index=0, attempt=1, trajectory_id=trajectory_id)
    assert current_rollout(gen, trajectory_id) is not context  # each direct agent_loop call gets its own


def test_an_attempts_cleanup_stats_and_client_are_its_batchs(tokenizer):
    gen = make_generator(tokenizer)
    batch_context = attempt(gen).batch
    one = RolloutContext(batch_context, RolloutRef(index=0, attempt=1, trajectory_id=None))
    two = RolloutContext(batch_context, RolloutRef(index=1, attempt=1, trajectory_id=None))
    assert one.cleanup is two.cleanup is batch_context.cleanup  # one tally per generate() call
    assert one.client is batch_context.client
    assert one.time_splits == {"llm": 0.0, "env": 0.0}
    assert one.time_splits is not two.time_splits
    assert one.abandoned == []
    assert one.abandoned is not two.abandoned


class CleanupsHeard(RolloutObserver):
    def __init__(self) -> None:
        self.heard: list[tuple[RolloutRef, CleanupKind]] = []

    def cleanup_started(self, rollout: RolloutRef, kind: CleanupKind) -> None:
        self.heard.append((rollout, kind))


def test_emit_tells_the_batchs_observers_about_this_attempt(tokenizer):
    gen = make_generator(tokenizer)
    observer = CleanupsHeard()
    context = attempt(gen, index=5, attempt=2, observers=Observers([observer]))
    context.emit(RolloutObserver.cleanup_started, "env_close")
    assert observer.heard == [(RolloutRef(index=5, attempt=2, trajectory_id=None), "env_close")]
    attempt(gen).emit(RolloutObserver.cleanup_started, "env_close")  # nobody listening: nothing to do


# ---------------------------------------------------------------------------------- request seeds


def test_without_a_sampling_seed_requests_go_out_as_given(tokenizer):
    context = attempt(make_generator(tokenizer), trajectory_id=TrajectoryID("q0", 0))
    params = {"temperature": 0.7}
    assert context.request_params(params, turn=0) is params
    assert context.request_params(None, turn=1) is None


def test_a_seeded_request_carries_the_seed_of_its_prompt_sample_turn_and_scope(tokenizer):
    gen = make_generator(tokenizer)
    context = attempt(gen, trajectory_id=TrajectoryID("q3", 1), sampling_seed=7, scope="train:4")
    params = {"temperature": 0.7}
    sent = context.request_params(params, turn=2)
    assert sent == {"temperature": 0.7, "seed": request_seed(7, scope="train:4", prompt="q3", sample=1, turn=2)}
    assert params == {"temperature": 0.7}  # the caller's dict is not changed
    assert context.request_params(params, turn=3) != sent  # each turn its own seed
    other_scope = attempt(gen, trajectory_id=TrajectoryID("q3", 1), sampling_seed=7, scope="train:5")
    assert other_scope.request_params(params, turn=2) != sent  # a later step samples other noise


def test_a_retry_sends_the_same_seeds_as_the_first_attempt(tokenizer):
    gen = make_generator(tokenizer)
    first = attempt(gen, attempt=1, trajectory_id=TrajectoryID("q3", 1), sampling_seed=7)
    retry = attempt(gen, attempt=3, trajectory_id=TrajectoryID("q3", 1), sampling_seed=7)
    turns = range(3)
    assert [first.request_params({}, turn) for turn in turns] == [retry.request_params({}, turn) for turn in turns]


def test_a_request_without_parameters_is_seeded_over_the_generators_defaults(tokenizer):
    gen = make_generator(tokenizer, sampling_params=SamplingParams(temperature=0.3, stop=["</answer>"]))
    context = attempt(gen, trajectory_id=TrajectoryID("q0", 0), sampling_seed=7)
    sent = context.request_params(None, turn=0)
    assert sent is not None
    defaults = engine_sampling_params(dataclasses.asdict(gen.generator_cfg.sampling_params))
    assert sent == {**defaults, "seed": request_seed(7, scope="", prompt="q0", sample=0, turn=0)}
    assert context.batch.engine_defaults() is context.batch.engine_defaults()  # built once per call


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.7, "seed": 123}, {"additional_kwargs": {"seed": 123}}],
    ids=["seed", "additional_kwargs-seed"],
)
def test_a_seed_the_caller_set_is_kept(tokenizer, params):
    context = attempt(make_generator(tokenizer), trajectory_id=TrajectoryID("q0", 0), sampling_seed=7)
    assert context.request_params(params, turn=0) is params


@pytest.mark.parametrize(
    "trajectory_id",
    [None, SimpleNamespace(instance_id="q1", repetition_id=True)],
    ids=["no-trajectory-id", "repetition-not-an-int"],
)
def test_without_a_usable_trajectory_id_the_batch_index_is_the_prompt(tokenizer, trajectory_id: Any):
    context = attempt(make_generator(tokenizer), index=4, trajectory_id=trajectory_id, sampling_seed=7)
    assert context.request_params({}, turn=1) == {"seed": request_seed(7, scope="", prompt="4", sample=0, turn=1)}


def test_seed_scope_is_the_batchs_phase_and_step():
    assert seed_scope(None) == ""
    assert seed_scope({"training_phase": "train", "global_step": 3}) == "train:3"
    assert seed_scope(SimpleNamespace(training_phase="eval", global_step=12)) == "eval:12"


# ------------------------------------------------------------------------------- sampling params


def test_sampling_params_read_from_a_dataclass_a_mapping_or_an_attribute_bag_alike():
    params = SamplingParams(temperature=0.2, stop=["x"])
    expected = dataclasses.asdict(params)
    assert sampling_params_dict(params) == expected
    assert sampling_params_dict(dict(expected)) == expected
    assert sampling_params_dict(SimpleNamespace(**expected)) == expected


def test_engine_sampling_params_in_the_engines_names_with_extra_arguments_that_override_nothing():
    sent = engine_sampling_params(
        {
            "max_generate_length": 64,
            "temperature": 0.2,
            "stop": ("</answer>",),
            "additional_kwargs": {"temperature": 9.9, "presence_penalty": 0.5},
        }
    )
    assert sent["max_tokens"] == 64
    assert sent["temperature"] == 0.2  # set by name: the extra argument does not replace it
    assert sent["presence_penalty"] == 0.5  # new names pass through
    assert sent["stop"] == ["</answer>"]
    assert (sent["min_tokens"], sent["skip_special_tokens"], sent["include_stop_str_in_output"]) == (1, True, True)
    assert engine_sampling_params({})["stop"] is None
