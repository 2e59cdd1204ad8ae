"""`skyrl-structured check`: a swapped SkyRL entrypoint tried on a CPU, as a user runs it (a real subprocess).

SkyRL's own parser, its trainer entrypoint's module (main_base), its ``validate_cfg``, the
experiment's ``get_generator`` and one generation step on the tiny offline model all run for real.
On Python 3.11 SkyRL's modules do not import (its pydantic models use ``typing.TypedDict``, which
pydantic takes only from Python 3.12, the version docs/swap.md asks for); there the subprocess
gets ``typing_extensions.TypedDict`` in its place through a ``sitecustomize`` on ``PYTHONPATH``,
the one difference from the documented route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("skyrl.train.config")
pytest.importorskip("jaxtyping")  # SkyRL's trainer entrypoint imports it (the [skyrl] extra has it)

pytestmark = pytest.mark.slow

_SHIM = """\
import sys

if sys.version_info < (3, 12):  # SkyRL's pydantic models need 3.12's TypedDict (tests/test_cli_check.py)
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict
"""

#: The three-line edit of docs/swap.md, with a get_generator that says what it was given.
_SWAPPED = """\
import sys

from skyrl_structured.integrations.skyrl import StructuredPPOExp, StructuredTrainConfig


class MyExp(StructuredPPOExp):
    def get_generator(self, cfg, tokenizer, inference_engine_client):
        print(
            f"MyExp.get_generator: skip_failed_rollouts={cfg.generator.skip_failed_rollouts} "
            f"max_env_workers={cfg.environment.skyrl_gym.max_env_workers}",
            file=sys.stderr,
        )
        return super().get_generator(cfg, tokenizer, inference_engine_client)


if __name__ == "__main__":
    print("the entrypoint's main ran", file=sys.stderr)
    MyExp(StructuredTrainConfig.from_cli_overrides(sys.argv[1:])).run()
"""

#: An entrypoint that forgot the swap: SkyRL's own experiment and config.
_NOT_SWAPPED = """\
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.entrypoints.main_base import BasePPOExp


class MyExp(BasePPOExp):
    pass
"""

#: Small enough for a CPU: 2 prompts x 2 samples, 8 tokens each.
_SMALL = (
    "trainer.logger=console",
    "generator.n_samples_per_prompt=2",
    "generator.sampling_params.max_generate_length=8",
)


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_SHIM, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "skyrl_structured", "check", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


#: One prompt in SkyRL's dataset format, for --data.
_ROW = {
    "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does Tom have now?"}],
    "env_class": "gsm8k",
    "reward_spec": {"method": "rule", "ground_truth": "8"},
}


@pytest.mark.parametrize(
    ("backend", "data", "rollouts"),
    [("asyncio", None, 4), ("trio", "prompts.jsonl", 2)],  # the embedded problems; one row of the user's
)
def test_a_swapped_entrypoint_is_checked_and_runs_one_generation_step(tmp_path, backend, data, rollouts):
    (tmp_path / "my_entrypoint.py").write_text(_SWAPPED, encoding="utf-8")
    (tmp_path / "prompts.jsonl").write_text(json.dumps(_ROW) + "\n", encoding="utf-8")
    proc = _check(
        tmp_path,
        "--entrypoint",
        "my_entrypoint.py",
        "--backend",
        backend,
        *(() if data is None else ("--data", data)),
        *_SMALL,
        "generator.skip_failed_rollouts=true",
        "environment.skyrl_gym.max_env_workers=2",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == [
        "entrypoint: my_entrypoint.py (MyExp), config StructuredTrainConfig",
        "generator: StructuredGymGenerator, built by MyExp.get_generator",
    ]
    assert lines[2].startswith(f"generation step: {rollouts} rollouts finished in ")
    assert lines[2].endswith(f" s on {backend}; the output passes validate_generator_output")
    assert lines[3:] == [
        "check passed: the swap and the configuration are ready for SkyRL's trainer (the GPU stack is not tried)"
    ]
    # The user's own get_generator built it, from the overrides as SkyRL's parser read them.
    assert "MyExp.get_generator: skip_failed_rollouts=True max_env_workers=2\n" in proc.stderr
    assert f"generation step: {rollouts} rollouts on the embedded engine (tiny offline model), backend {backend}\n" in (
        proc.stderr
    )
    assert "the entrypoint's main ran" not in proc.stderr  # imported, not run: no training starts


def test_a_misspelled_key_is_refused_in_one_line_with_did_you_mean(tmp_path):
    proc = _check(tmp_path, *_SMALL, "generator.sampling_params.temprature=0.5")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [
        "skyrl-structured: error: unknown key `generator.sampling_params.temprature`; did you mean "
        "`generator.sampling_params.temperature`?"
    ]


def test_an_entrypoint_without_the_swap_is_refused(tmp_path):
    (tmp_path / "old_entrypoint.py").write_text(_NOT_SWAPPED, encoding="utf-8")
    proc = _check(tmp_path, "--entrypoint", "old_entrypoint.py", *_SMALL)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    # The config class it names is SkyRL's own, which SkyRL's parser reads; the generator is SkyRL's.
    assert proc.stderr.splitlines()[-1] == (
        "skyrl-structured: error: MyExp.get_generator returns SkyRLGymGenerator, not StructuredGymGenerator: "
        "the swap is missing; derive the experiment from StructuredPPOExp (docs/swap.md)"
    )


def test_check_help_says_what_it_runs_and_what_to_install():
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_structured", "check", "--help"], capture_output=True, text=True, check=True
    )
    text = " ".join(proc.stdout.split())
    assert "through SkyRL's own parser" in text
    assert "pip install -e '/path/to/skyrl_structured[skyrl]' on Python 3.12" in text
    assert "--entrypoint FILE|MODULE[:CLASS]" in text


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="SkyRL's modules import on Python 3.12")
def test_on_python_3_11_the_check_says_which_python_and_install_it_needs(tmp_path):
    # No shim here: what a user on Python 3.11 sees, for this package's entrypoint and for their own.
    (tmp_path / "my_entrypoint.py").write_text(_SWAPPED, encoding="utf-8")
    for args in ((), ("--entrypoint", "my_entrypoint.py")):
        proc = subprocess.run(
            [sys.executable, "-m", "skyrl_structured", "check", *args, *_SMALL],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
        (line,) = proc.stderr.splitlines()
        assert "(PydanticUserError: Please use `typing_extensions.TypedDict` instead of `typing.TypedDict`" in line
        assert line.endswith(
            "for this check: pip install -e '/path/to/skyrl_structured[skyrl]' on Python 3.12 "
            "(docs/swap.md, 'Before booking GPUs')"
        )
