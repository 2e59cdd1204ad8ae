"""SkyRL's observation-encoding attributes are live on StructuredGymGenerator.

``base_conversation``, ``base_conversation_token_ids`` and ``generation_prompt_ids`` are read by
SkyRL's ``get_obs_ids_from_obs`` at use time, and SkyRL's tests and users' subclasses assign them.
Each test makes the same assignment on SkyRL's generator and ours and requires the same encoding:
``get_obs_ids_from_obs`` directly, and the whole ``generate()`` output, field by field.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from skyrl_structured import GeneratorConfig, SkyRLGymConfig, StructuredGymGenerator
from skyrl_structured.testing import ScriptedEngine
from tests._parity import REPLIES, assert_same_output, batch, copy_batch, engine_inputs, turn_handler
from tests.helpers import run_asyncio

from ._upstream import load_upstream_generator

SkyRLGymGenerator = load_upstream_generator()

# ChatML that rejects two user messages in a row, as Mistral's and Gemma's templates do: SkyRL's
# default base (system, user) followed by a user observation does not render under it.
STRICT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.index0 > 0 and m['role'] == 'user' and messages[loop.index0 - 1]['role'] == 'user' -%}"
    "{{- raise_exception('user messages must alternate with assistant ones') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

USER_OBS = {"role": "user", "content": "<observation>3 + 5 = 8</observation>"}
OBSERVATIONS: list[list[dict[str, str]]] = [[], [USER_OBS], [USER_OBS, {"role": "tool", "content": "8"}]]
STRICT_OBSERVATIONS: list[list[dict[str, str]]] = [[], [USER_OBS]]


def base_ids_for(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    """Token ids of ``conversation`` cut after the last EOS, as SkyRL derives its default."""
    ids = list(
        tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True, return_dict=False)
    )
    last = len(ids) - 1 - ids[::-1].index(tokenizer.eos_token_id)
    return ids[: last + 1]


def system_prompt_base(gen: Any, tokenizer: Any) -> None:
    base = [
        {"role": "system", "content": "You grade arithmetic tersely."},
        {"role": "user", "content": "Ready?"},
        {"role": "assistant", "content": "Yes."},
    ]
    gen.base_conversation = base
    gen.base_conversation_token_ids = base_ids_for(tokenizer, base)


def cleared_token_ids(gen: Any, _tokenizer: Any) -> None:
    # The idiom of SkyRL's own generator tests.
    gen.base_conversation_token_ids = []


def untrimmed_token_ids(gen: Any, tokenizer: Any) -> None:
    # Keeps the newline after the last EOS, so the observation loses its leading newline.
    gen.base_conversation_token_ids = list(
        tokenizer.apply_chat_template(
            gen.base_conversation, add_generation_prompt=False, tokenize=True, return_dict=False
        )
    )


def conversation_only(gen: Any, _tokenizer: Any) -> None:
    # SkyRL does not recompute the token ids: the cut stays at the default base's length.
    gen.base_conversation = [{"role": "user", "content": "Hi."}]


def generation_prompt(gen: Any, tokenizer: Any) -> None:
    gen.generation_prompt_ids = tokenizer.encode("<|im_start|>assistant\nAnswer: ", add_special_tokens=False)


def edited_in_place(gen: Any, tokenizer: Any) -> None:
    gen.base_conversation.append({"role": "assistant", "content": "Noted."})
    gen.generation_prompt_ids.extend(tokenizer.encode("Step:", add_special_tokens=False))


@dataclass(frozen=True)
class Assignment:
    name: str
    apply: Callable[[Any, Any], None]
    strict: bool = False

    def __str__(self) -> str:
        return self.name


ASSIGNMENTS = [
    Assignment("system_prompt_base", system_prompt_base, strict=True),
    Assignment("cleared_token_ids", cleared_token_ids),
    Assignment("untrimmed_token_ids", untrimmed_token_ids),
    Assignment("conversation_only", conversation_only),
    Assignment("generation_prompt", generation_prompt),
    Assignment("edited_in_place", edited_in_place),
]


@pytest.fixture(scope="module")
def strict_tokenizer(tokenizer: Any) -> Any:
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = STRICT_TEMPLATE
    return strict


def pick_tokenizer(assignment: Assignment, tokenizer: Any, strict_tokenizer: Any) -> Any:
    return strict_tokenizer if assignment.strict else tokenizer


def build_pair(tokenizer: Any, cfg: Any, engines: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
    """(ours, SkyRL's) on the same configuration and tokenizer."""
    gym_cfg = SkyRLGymConfig(max_env_workers=4)
    pair: tuple[Any, Any] = engines or (None, None)  # None: attribute checks that make no engine call
    ours_engine, theirs_engine = pair
    ours = StructuredGymGenerator(cfg, gym_cfg, ours_engine, tokenizer)
    theirs = SkyRLGymGenerator(cfg, gym_cfg, theirs_engine, tokenizer)
    return ours, theirs


def encodings(gen: Any, observations: list[list[dict[str, str]]]) -> list[list[int] | str]:
    """Every observation's ids, done and not done (a template error is recorded by type name)."""
    out: list[list[int] | str] = []
    for obs in observations:
        for done in (False, True):
            try:
                out.append(list(gen.get_obs_ids_from_obs(copy.deepcopy(obs), done)))
            except Exception as exc:
                out.append(type(exc).__name__)
    return out


@pytest.mark.parametrize("multi_turn", [True, False])
def test_defaults_read_like_skyrl(tokenizer: Any, multi_turn: bool) -> None:
    ours, theirs = build_pair(tokenizer, GeneratorConfig(use_conversation_multi_turn=multi_turn))
    assert ours.base_conversation == theirs.base_conversation
    assert ours.base_conversation_token_ids == theirs.base_conversation_token_ids
    assert ours.generation_prompt_ids == theirs.generation_prompt_ids
    # What is read is what encodes: a value read and assigned back changes nothing.
    before = encodings(ours, OBSERVATIONS)
    ours.base_conversation = ours.base_conversation
    ours.base_conversation_token_ids = ours.base_conversation_token_ids
    ours.generation_prompt_ids = ours.generation_prompt_ids
    assert encodings(ours, OBSERVATIONS) == before == encodings(theirs, OBSERVATIONS)


@pytest.mark.parametrize("assignment", ASSIGNMENTS, ids=str)
def test_get_obs_ids_after_assignment(tokenizer: Any, strict_tokenizer: Any, assignment: Assignment) -> None:
    tok = pick_tokenizer(assignment, tokenizer, strict_tokenizer)
    observations = STRICT_OBSERVATIONS if assignment.strict else OBSERVATIONS
    ours, theirs = build_pair(tok, GeneratorConfig())
    default = encodings(theirs, observations)
    assignment.apply(ours, tok)
    assignment.apply(theirs, tok)
    expected = encodings(theirs, observations)
    assert expected != default, "the assignment should change SkyRL's encoding"
    assert encodings(ours, observations) == expected
    assert ours.base_conversation == theirs.base_conversation
    assert ours.base_conversation_token_ids == theirs.base_conversation_token_ids
    assert ours.generation_prompt_ids == theirs.generation_prompt_ids
    # Assignments and in-place edits stay with that one generator.
    fresh, _ = build_pair(tok, GeneratorConfig())
    assert encodings(fresh, observations) == default


def script_with_silent_turn() -> list[dict[str, Any]]:
    # The second turn observes nothing without ending: only the generation prompt is appended.
    return [
        {"observation": "<observation>not yet</observation>", "reward": 0.25},
        {"observation": None, "reward": 0.0},
        {"observation": "Try once more.", "reward": 0.5},
        {"observation": None, "reward": 1.0, "done": True},
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("step_wise", [False, True], ids=["trajectories", "step_wise"])
@pytest.mark.parametrize("assignment", ASSIGNMENTS, ids=str)
async def test_generate_after_assignment(
    tokenizer: Any, strict_tokenizer: Any, assignment: Assignment, step_wise: bool
) -> None:
    tok = pick_tokenizer(assignment, tokenizer, strict_tokenizer)
    cfg = GeneratorConfig(max_turns=4, max_input_length=4096, step_wise_trajectories=step_wise)
    ours_engine = ScriptedEngine(tok, turn_handler(REPLIES))
    theirs_engine = ScriptedEngine(tok, turn_handler(REPLIES))
    ours, theirs = build_pair(tok, cfg, (ours_engine, theirs_engine))
    assignment.apply(ours, tok)
    assignment.apply(theirs, tok)
    b = batch(3, script=script_with_silent_turn)

    theirs_batch = copy_batch(b)
    # SkyRL's generator is asyncio-only: it runs on its own loop in a worker thread.
    expected = await anyio.to_thread.run_sync(lambda: run_asyncio(theirs.generate(theirs_batch, disable_tqdm=True)))
    got = await ours.generate(copy_batch(b), disable_tqdm=True)

    assert_same_output(dict(got), dict(expected))
    assert engine_inputs(ours_engine) == engine_inputs(theirs_engine)
