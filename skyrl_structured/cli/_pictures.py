"""The CLI's offline multimodal default: count-the-squares prompts whose environment shows pictures.

``skyrl-structured rollout generator.vision_language_generator=true`` without ``data.path`` runs
these rows: each asks how many squares a picture holds; the environment (:class:`PictureEnv`)
adds the picture (a small generated PNG) to the prompt in ``init``, rewards an answer that names
the count after ``####`` and otherwise answers with the picture again, larger, until
``max_turns``. Nothing is downloaded and no image library is needed.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from ..testing.vision import encode_png, image_part
from ._data import Dataset

__all__ = ["PICTURE_ENV", "PictureEnv", "picture_dataset", "register_picture_env", "squares_png"]

#: The environment id the rows use.
PICTURE_ENV = "skyrl_structured_pictures"

_QUESTION = 'How many white squares are in the picture? Look carefully, then give the count after "####".'
_ANSWER = re.compile(r"####\s*(\d+)")


def squares_png(count: int, seed: int, *, scale: int = 1) -> bytes:
    """``count`` white squares in a row on a tinted background, ``scale`` times the base size (8 px squares)."""
    side = 8 * scale
    width, height = side * (2 * count + 1), side * 3

    def pixel(x: int, y: int) -> tuple[int, int, int]:
        column, row = x // side, y // side
        if row == 1 and column % 2 == 1:
            return 255, 255, 255
        return (seed * 40) % 128, (seed * 70) % 128, 64

    return encode_png(width, height, pixel)


class PictureEnv(BaseTextEnv):  # type: ignore[misc]  # skyrl_gym ships no type information
    """Shows a picture of ``extras["squares"]`` squares; reward 1.0 for the right count after ``####``."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.squares = int(extras["squares"])
        self.seed = int(extras.get("seed", 0))
        self.max_turns = int(extras.get("max_turns", 2))

    def init(self, prompt: Any) -> tuple[Any, dict[str, Any]]:
        conversation = copy.deepcopy(prompt)
        last = conversation[-1]
        text = last["content"] if isinstance(last["content"], str) else ""
        last["content"] = [{"type": "text", "text": text}, image_part(squares_png(self.squares, self.seed))]
        return conversation, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        found = _ANSWER.search(action)
        correct = found is not None and int(found.group(1)) == self.squares
        done = correct or self.turns >= self.max_turns
        observations = []
        if not done:
            larger = image_part(squares_png(self.squares, self.seed, scale=2))
            observations = [{"role": "user", "content": [{"type": "text", "text": "Not quite. Larger:"}, larger]}]
        return BaseTextEnvStepOutput(
            observations=observations, reward=1.0 if correct else 0.0, done=done, metadata={"correct": correct}
        )

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns}


def register_picture_env() -> str:
    """Register :class:`PictureEnv` with ``skyrl_gym`` (idempotent); return its id."""
    if PICTURE_ENV not in skyrl_gym.registry:
        skyrl_gym.register(id=PICTURE_ENV, entry_point=PictureEnv)
    return PICTURE_ENV


def picture_dataset(max_prompts: int | None = None, *, rows: int = 8) -> Dataset:
    """The embedded multimodal rows (1 to 3 squares each), at most ``max_prompts`` of them."""
    register_picture_env()
    count = rows if max_prompts is None else min(rows, max_prompts)
    squares = [1 + i % 3 for i in range(count)]
    return Dataset(
        source="embedded pictures (generated count-the-squares images)",
        prompts=[[{"role": "user", "content": _QUESTION}] for _ in squares],
        env_classes=[PICTURE_ENV] * count,
        env_extras=[
            {"squares": n, "seed": i, "reward_spec": {"method": "rule", "ground_truth": str(n)}}
            for i, n in enumerate(squares)
        ],
    )
