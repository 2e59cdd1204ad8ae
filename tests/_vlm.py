"""A vision-language batch shared by the SkyRL integration and mock-config tests: pictures in the prompts
and in an env observation."""

from __future__ import annotations

from skyrl_structured import GeneratorInput, TrajectoryID
from skyrl_structured.testing import image_part, png_image
from skyrl_structured.testing.envs import SCRIPTED_ENV


def vlm_picture_batch(n: int) -> GeneratorInput:
    script = [
        {"observation": [{"type": "text", "text": "Now?"}, image_part(png_image(8, 8, seed=3))], "reward": 0.0},
        {"observation": None, "reward": 1.0, "done": True},
    ]
    return {
        "prompts": [
            [{"role": "user", "content": [{"type": "text", "text": f"Picture {i}"}, image_part(png_image(8, 8, i))]}]
            for i in range(n)
        ],
        "env_classes": [SCRIPTED_ENV] * n,
        "env_extras": [{"script": list(script)} for _ in range(n)],
        "trajectory_ids": [TrajectoryID(f"q{i // 2}", i % 2) for i in range(n)],
    }
