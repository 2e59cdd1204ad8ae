"""`skyrl-structured rollout` logging: every library line once, repeated warnings counted on one line.

The runs are real subprocesses (embedded data, tiny offline model) whose environment is a small
module written into the run's directory: it logs through ``huggingface_hub``'s and
``transformers``' loggers (which install handlers of their own) and warns once per rollout.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skyrl_structured.cli._logs import AggregatingHandler

pytestmark = pytest.mark.slow

ROLLOUTS = 4  # 2 prompts x 2 samples

CHATTY_ENV = textwrap.dedent(
    """
    import logging

    from huggingface_hub.utils import logging as hub_logging
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
    from transformers.utils import logging as hf_logging

    hub_logging.get_logger("huggingface_hub.chatty").warning("hub says hello once")
    hf_logging.get_logger("transformers.chatty").warning("transformers says hello once")
    logger = logging.getLogger("chatty_env")


    class ChattyEnv(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()
            self.row = (extras or {}).get("extra_info", {}).get("index")

        def step(self, action):
            logger.warning("could not parse an answer for row %s: ValueError: no '####' in the reply", self.row)
            return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, metadata={})

    """
)


def _rollout(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "chatty_env.py").write_text(CHATTY_ENV)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{i} + 1?"}],
            "env_class": "chatty_env:ChattyEnv",
            "extra_info": {"index": i},
        }
        for i in range(ROLLOUTS // 2)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_structured",
            "rollout",
            "data.path=rows.jsonl",
            "generator.n_samples_per_prompt=2",
            "generator.max_turns=1",
            "generator.sampling_params.max_generate_length=4",
            "run.progress=false",
            f"run.output_dir={tmp_path / 'out'}",
            *args,
        ],
        cwd=tmp_path,  # `python -m` puts it first on sys.path: chatty_env imports from there
        # transformers' own handler propagates only where CI is set: set it, so both libraries
        # would print their lines twice through the command's root handler.
        env={**os.environ, "CI": "true"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_library_log_lines_appear_once_and_repeated_warnings_collapse_into_a_count(tmp_path):
    proc = _rollout(tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    for text in ("hub says hello once", "transformers says hello once"):
        assert [line for line in lines if text in line] == [
            f"WARNING {'huggingface_hub' if 'hub' in text else 'transformers'}.chatty: {text}"
        ], proc.stderr

    # One warning per rollout: the first in full, then one counted line for all of them.
    parse = [line for line in lines if "could not parse an answer" in line]
    assert len(parse) == 2, proc.stderr
    assert re.fullmatch(
        r"WARNING chatty_env: could not parse an answer for row \d: ValueError: no '####' in the reply", parse[0]
    )
    assert parse[1].startswith(f"  {ROLLOUTS} x WARNING chatty_env, first: could not parse an answer for row ")
    assert "repeated log lines (1 kind; the first of each is shown in full above):" in lines
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "ok"


def _record(name: str, msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_aggregating_handler_counts_each_kind_and_shows_the_first_in_full():
    written: list[str] = []
    handler = AggregatingHandler(written.append)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    long_reason = "x" * 300
    for i in range(48):
        handler.handle(
            _record("lib.http", "server %s unreachable (%s)", f"http://h{i % 2}", f"ConnectError: {long_reason}")
        )
    for _ in range(3):
        handler.handle(_record("lib.http", "server %s unreachable (%s)", "http://h0", "ReadTimeout: slow"))
    handler.handle(_record("lib.other", "a one-off warning"))
    for i in range(5):
        handler.handle(_record("lib.http", "request %d sent", i, level=logging.INFO))  # asked-for detail: all shown

    assert written[:3] == [
        f"WARNING lib.http: server http://h0 unreachable (ConnectError: {long_reason})",
        "WARNING lib.http: server http://h0 unreachable (ReadTimeout: slow)",  # another failure type
        "WARNING lib.other: a one-off warning",
    ]
    assert written[3:] == [f"INFO lib.http: request {i} sent" for i in range(5)]
    summary = handler.summary_lines()
    assert summary[0] == "repeated log lines (2 kinds; the first of each is shown in full above):"
    assert summary[1].startswith("  48 x WARNING lib.http, first: server http://h0 unreachable (ConnectError: xxx")
    assert summary[1].endswith("...")
    assert len(summary[1]) < 200
    assert summary[2] == "  3 x WARNING lib.http, first: server http://h0 unreachable (ReadTimeout: slow)"
    assert len(summary) == 3
