"""``generator.oversample_groups`` through SkyRL: its synchronous trainer's filter loop fed by ``InformativeBatches``.

SkyRL's own pieces run as written: its parser reads the keys (design rule 18), its
``prepare_generator_input`` builds each dataloader batch, and its ``RayPPOTrainer.handle_dynamic_sampling``
with ``trainer_utils``' filter (compiled from the installed source: the trainer module needs Ray and
Python 3.12) filters, accumulates and decides when a step has its groups. The loop around them is
the shape of ``RayPPOTrainer.train``'s (take a batch, ``generate``, ``handle_dynamic_sampling``,
``continue`` while it says so); the hook replaces ``trainer.generate`` as ``StructuredPPOExp`` does.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from skyrl_structured import StructuredGymGenerator
from skyrl_structured.engines.partial import offer_partial
from skyrl_structured.integrations._dynamic_sampling import sample_informative_batches
from skyrl_structured.testing import EngineCall, Reply, ScriptedEngine

from ._upstream import load_upstream_generator, upstream_dynamic_sampling

pytestmark = pytest.mark.anyio

BATCH = 3  # trainer.train_batch_size: prompt groups per step
SAMPLES = 2
KEYS = [
    "trainer.algorithm.dynamic_sampling.type=filter",
    f"trainer.train_batch_size={BATCH}",
    f"generator.n_samples_per_prompt={SAMPLES}",
    "generator.skip_failed_rollouts=true",
    "generator.failure_budget_action=warn",
    "generator.carry_over_cut_rollouts=true",
    "generator.oversample_groups=1.0",
    # A share cutoff too: a step's first call has only the dataloader's batch to run, none extra.
    "generator.straggler_cutoff=0.8",
    "generator.max_turns=1",
    "generator.max_input_length=4096",
]


def dataset_row(k: int) -> dict[str, Any]:
    """A row as SkyRL's ``PromptDataset`` yields it."""
    return {
        "prompt": [{"role": "user", "content": f"What is {k} + 3?"}],
        "env_class": "gsm8k",
        "env_extras": {"reward_spec": {"method": "rule", "ground_truth": str(k + 3)}},
        "uid": f"g{k}",
    }


class Grader:
    """Every third group's samples all answer right (uninformative); otherwise sample 0 right, sample 1 wrong.

    Sample 1 of g1 starts, hands back two tokens and waits until cut; the others wait until it is in.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.hung = {"g1_1"}
        self.hung_in = anyio.Event()
        self.continued: list[str] = []

    def ids(self, session: str) -> list[int]:
        uid, repetition = session.rsplit("_", 1)
        k = int(uid[1:])
        right = k % 3 == 2 or repetition == "0"
        text = f"The answer is #### {k + 3 if right else k + 4}"
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]

    async def __call__(self, call: EngineCall) -> Reply:
        session = str(call.session_id)
        ids = self.ids(session)
        if call.prompt_token_ids[-2:] == ids[:2]:
            self.continued.append(session)
            return Reply(self.tokenizer.decode(ids[2:], skip_special_tokens=True), token_ids=ids[2:])
        if session in self.hung:
            self.hung.discard(session)
            self.hung_in.set()
            offer_partial(ids[:2], None, self.tokenizer.decode(ids[:2], skip_special_tokens=True))
            await anyio.sleep_forever()
        await self.hung_in.wait()
        return Reply(self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids)


class SimTrainer:
    """What the hook and SkyRL's ``handle_dynamic_sampling`` read of ``RayPPOTrainer``."""

    def __init__(self, cfg: Any, generator: StructuredGymGenerator, handle: Any) -> None:
        self.cfg = cfg
        self.generator = generator
        self.all_metrics: dict[str, Any] = {}
        self.dynamic_sampling_state: dict[str, Any] | None = None
        self._handle = handle

    async def generate(self, generator_input: Any) -> Any:  # replaced by the hook
        raise AssertionError("the hook replaces trainer.generate")

    def handle_dynamic_sampling(self, generator_output: Any, uids: list[str]) -> Any:
        return self._handle(self, generator_output, uids)


async def test_skyrls_filter_loop_gets_whole_informative_steps_from_informative_batches(
    tokenizer: Any, request: pytest.FixtureRequest
) -> None:
    load_upstream_generator()  # before the parser's stand-ins for SkyRL's training stack
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.train.generators.utils import prepare_generator_input

    cfg = request.getfixturevalue("skyrl_cli_parser")(KEYS)
    integration = pytest.importorskip("skyrl_structured.integrations.skyrl")
    integration.check_structured_config(cfg)  # the documented keys pass
    grader = Grader(tokenizer)
    generator = integration.structured_generator(cfg, tokenizer, ScriptedEngine(tokenizer, grader, logprobs=False))
    assert isinstance(generator, StructuredGymGenerator)
    dataloader = [[dataset_row(BATCH * b + k) for k in range(BATCH)] for b in range(8)]
    steps: list[tuple[Any, list[str]]] = []
    with upstream_dynamic_sampling() as handle:
        trainer = SimTrainer(cfg, generator, handle)
        batches = sample_informative_batches(trainer, generator, cfg)
        assert sample_informative_batches(trainer, generator, cfg) is batches  # installed once
        step = 0
        for rand_prompts in dataloader:  # RayPPOTrainer.train's loop, as far as dynamic sampling goes
            generator_input, uids = prepare_generator_input(
                rand_prompts,
                SAMPLES,
                get_sampling_params_for_backend("vllm", cfg.generator.sampling_params),
                "gsm8k",
                "train",
                step,
            )
            output = await trainer.generate(generator_input)
            output, uids, keep_sampling = trainer.handle_dynamic_sampling(output, uids)
            if keep_sampling:
                continue
            steps.append((output, uids))
            generator.advance_policy_version()  # the weight sync
            step += 1
            if step == 2:
                break
    assert len(steps) == 2
    trained: list[str] = []
    for output, uids in steps:
        assert len(uids) == BATCH * SAMPLES
        assert len(output["response_ids"]) == BATCH * SAMPLES
        groups = [uids[i] for i in range(0, len(uids), SAMPLES)]
        for g, uid in enumerate(groups):
            assert uids[g * SAMPLES : (g + 1) * SAMPLES] == [uid] * SAMPLES
            scores = [sum(output["rewards"][r]) for r in range(g * SAMPLES, (g + 1) * SAMPLES)]
            assert max(scores) != min(scores), (uid, scores)  # informative: no uninformative group trains
        trained += groups
        assert trainer.dynamic_sampling_state is None  # SkyRL's filter closed the step
    assert len(set(trained)) == len(trained)  # no group trained twice
    assert "g1" in trained
    assert grader.continued == ["g1_1"]  # its cut sample was parked and resumed, not sampled again
    assert "generate/informative/groups" in trainer.all_metrics
    await generator.aclose()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["trainer.algorithm.dynamic_sampling.type=replace"], r"dynamic_sampling.type` is 'replace'"),
        (["generator.carry_over_cut_rollouts=false"], r"needs `generator.carry_over_cut_rollouts=true`"),
        (["generator.oversample_groups=-0.5"], r"generator.oversample_groups"),
    ],
)
def test_oversample_groups_is_refused_in_one_line_where_it_cannot_run(
    skyrl_cli_parser: Any, keys: list[str], message: str
) -> None:
    integration = pytest.importorskip("skyrl_structured.integrations.skyrl")
    overrides = {k.partition("=")[0]: k for k in KEYS} | {k.partition("=")[0]: k for k in keys}
    cfg = skyrl_cli_parser(list(overrides.values()))
    with pytest.raises(ValueError, match=message):
        integration.check_structured_config(cfg)
