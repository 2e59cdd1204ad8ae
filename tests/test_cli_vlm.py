"""`skyrl-structured rollout generator.vision_language_generator=true`: the offline multimodal default.

A subprocess, the real tiny model behind the scripted image renderer, the picture environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_structured import validate_generator_output

pytestmark = pytest.mark.slow


def test_the_multimodal_default_runs_offline(tmp_path: Path):
    pytest.importorskip("torch")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_structured",
            "rollout",
            "generator.vision_language_generator=true",
            f"run.output_dir={tmp_path / 'out'}",
            "data.max_prompts=3",
            "generator.n_samples_per_prompt=2",
            "generator.max_turns=2",
            "generator.sampling_params.max_generate_length=8",
            "run.progress=false",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "from embedded pictures (generated count-the-squares images)" in proc.stderr
    assert "scripted image renderer" in proc.stderr
    assert "environments        6 opened = 6 closed" in proc.stdout
    output = json.loads((tmp_path / "out" / "generator_output.json").read_text())
    validate_generator_output(6, output)
    # Every rollout saw its picture (and, if it answered wrong, the larger one): grids of [t, h, w] rows.
    grids = output["image_grid_thw"]
    assert len(grids) == 6
    for grid, stop in zip(grids, output["stop_reasons"], strict=True):
        assert grid[0] in ([1, 6, 6], [1, 6, 10], [1, 6, 14])
        assert all(len(row) == 3 for row in grid)
        assert stop in ("stop", "length")
    assert len(output["pixel_values"]) == 6
