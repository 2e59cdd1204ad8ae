"""Run one batch of multi-turn rollouts through StructuredGymGenerator, offline, on CPU.

The engine is scripted (deterministic answers), the environment is skyrl_gym's real
``gsm8k_multi_turn``, the tokenizer a real Hugging Face fast tokenizer built offline. One rollout
in four hits a simulated network error and is contained as a placeholder.
"""

from __future__ import annotations

import anyio

from skyrl_structured import (
    GeneratorConfig,
    SkyRLGymConfig,
    StructuredGymGenerator,
    TrajectoryID,
    validate_generator_output,
)
from skyrl_structured.testing import EngineCall, ScriptedEngine
from skyrl_structured.tiny import build_chatml_tokenizer


def answer(call: EngineCall) -> str:
    if str(call.session_id).endswith("_3"):
        raise ConnectionError("simulated network blip")
    return "3 + 5 = 8. #### 8"


async def main() -> None:
    tokenizer = build_chatml_tokenizer()
    engine = ScriptedEngine(tokenizer, answer)
    generator = StructuredGymGenerator(
        GeneratorConfig(max_turns=3, max_input_length=2048, skip_failed_rollouts=True),
        SkyRLGymConfig(max_env_workers=4),
        engine,
        tokenizer,
    )
    n = 8
    batch = {
        "prompts": [[{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many?"}]] * n,
        "env_classes": ["gsm8k_multi_turn"] * n,
        "env_extras": [{"reward_spec": {"ground_truth": "8"}, "extra_info": {}} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(instance_id=f"q{i // 4}", repetition_id=i % 4) for i in range(n)],
    }
    output = await generator.generate(batch)
    validate_generator_output(n, output)
    metrics = output["rollout_metrics"] or {}
    print(f"rollouts: {n}, failed: {metrics['generate/num_failed_rollouts']}")
    print(f"stop reasons: {output['stop_reasons']}")
    print(f"rewards (sum per rollout): {[round(sum(r), 3) for r in output['rewards']]}")


if __name__ == "__main__":
    anyio.run(main)
