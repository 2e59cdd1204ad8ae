"""`skyrl-structured rollout agent=...`: OpenAI-API agents instead of gym rollouts, offline, end to end.

The runs are subprocesses on the real tiny random model (the CLI's offline default engine), the
embedded arithmetic problems and the real ``openai`` client inside the agents; refusals run in
process, since they stop before any model loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from skyrl_structured import validate_generator_output
from skyrl_structured.cli import main
from skyrl_structured.cli._config import load_config
from skyrl_structured.cli._values import ConfigError
from tests.trace_check import spans_by_track

#: A small step: 2 prompts x 2 samples, short replies, so a run takes seconds of generation.
SMALL = ("data.max_prompts=2", "generator.n_samples_per_prompt=2", "generator.sampling_params.max_generate_length=8")
ROLLOUTS = 4


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skyrl_structured", "rollout", f"run.output_dir={tmp_path / 'out'}", *SMALL, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _row(stdout: str, label: str) -> str:
    match = re.search(rf"^  {label}\s{{2,}}(.+)$", stdout, re.MULTILINE)
    assert match is not None, f"no {label!r} row in:\n{stdout}"
    return match.group(1)


def _outputs(tmp_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    out = tmp_path / "out"
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return (
        json.loads((out / "generator_output.json").read_text()),
        trajectories,
        json.loads((out / "summary.json").read_text()),
    )


@pytest.mark.slow
def test_the_default_agents_bar_counts_chat_calls_before_any_rollout_finishes(tmp_path):
    proc = _run(tmp_path, "agent=default", "run.progress=true")
    assert proc.returncode == 0, proc.stderr
    renders = proc.stderr.replace("\n", "\r").split("\r")
    bars = [render for render in renders if render.startswith("Generating Trajectories")]
    # The first chat call that came back is drawn at once, before any rollout's last call: whatever the speed.
    assert any(f"0/{ROLLOUTS}" in bar and "calls=1" in bar for bar in bars), bars
    assert re.search(rf"{ROLLOUTS}/{ROLLOUTS} .*calls=\d+", bars[-1]), bars


@pytest.mark.slow
def test_the_default_agent_runs_offline_and_reports_calls_branches_tools_and_rewards(tmp_path):
    proc = _run(tmp_path, "agent=default", "run.progress=false")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "; agent default (OpenAI chat API, captured token-exact); " in proc.stderr.splitlines()[0]
    output, trajectories, summary = _outputs(tmp_path)
    validate_generator_output(ROLLOUTS, output)
    assert summary["status"] == "ok"
    assert summary["rollouts_ok"] == ROLLOUTS
    assert summary["agent"] == "default"
    counts = summary["agent_counts"]
    # Every rollout goes through one tool turn at least: the model's own calls, or the agent's when it made none.
    assert counts["tool_calls"] >= ROLLOUTS
    assert 0 <= counts["model_tool_calls"] <= counts["tool_calls"]
    # Three chat calls per rollout, one more per further round of the model's tool calls.
    assert summary["agent_calls"] >= 3 * ROLLOUTS
    assert ROLLOUTS <= summary["agent_branches"] <= summary["agent_calls"]
    metrics = summary["rollout_metrics"]
    for name in ("agent_calls", "agent_branches", "agent_multi_branch_rollouts"):
        assert metrics[f"generate/{name}"] == summary[name]
    per = summary["agent_calls"] / ROLLOUTS
    assert _row(proc.stdout, "agent") == (
        f"default: {summary['agent_calls']} chat calls ({per:.1f} per rollout), {summary['agent_branches']} branches, "
        f"{summary['agent_multi_branch_rollouts']} rollouts with more than one"
    )
    assert _row(proc.stdout, "agent results") == (
        f"model_tool_calls {counts['model_tool_calls']}, tool_calls {counts['tool_calls']}"
    )
    assert re.fullmatch(r"\d\.\d{3} \(\d+ of 4 rollouts rewarded\)", _row(proc.stdout, "mean reward"))
    assert "environments" not in proc.stdout  # no environment ran
    assert [row["reward"] for row in trajectories] == [r[-1] if isinstance(r, list) else r for r in output["rewards"]]
    # Agent rollouts are observed like gym ones: one attempt each, one engine span per chat call.
    assert summary["rollout_attempts"] == ROLLOUTS
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    tracks = spans_by_track(trace)
    assert sorted(tid for _, tid in tracks) == list(range(ROLLOUTS))
    engine_spans = [s for spans in tracks.values() for s in spans if s["name"] == "engine"]
    assert len(engine_spans) == summary["agent_calls"]
    assert not any(s["args"].get("unfinished") for spans in tracks.values() for s in spans)


AGENT_MODULE = textwrap.dedent(
    """
    import openai

    async def solve(ctx):
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            models = await client.models.list()
            reply = await client.chat.completions.create(model=models.data[0].id, messages=ctx.prompt)
        return {"reward": 0.25, "replies": 1}
    """
)


@pytest.mark.slow
def test_a_module_function_agent_runs_on_trio(tmp_path):
    (tmp_path / "my_agent.py").write_text(AGENT_MODULE)  # found from the current directory
    proc = _run(tmp_path, "agent=my_agent:solve", "run.backend=trio", "run.progress=false")
    assert proc.returncode == 0, proc.stderr
    output, _, summary = _outputs(tmp_path)
    validate_generator_output(ROLLOUTS, output)
    assert summary["backend"] == "trio"
    assert summary["mean_reward"] == 0.25
    assert summary["agent_calls"] == summary["agent_branches"] == ROLLOUTS
    assert summary["agent_counts"] == {"replies": ROLLOUTS}
    assert _row(proc.stdout, "agent results") == f"replies {ROLLOUTS}"


SYNC_AGENT_MODULE = textwrap.dedent(
    """
    import threading

    import openai

    def solve(ctx):
        assert threading.current_thread() is not threading.main_thread()
        with openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            client.chat.completions.create(model=ctx.model, messages=ctx.prompt)
        return {"reward": 0.5, "replies": 1}
    """
)


@pytest.mark.slow
def test_a_plain_function_agent_runs_in_worker_threads_and_its_numbers_are_counted(tmp_path):
    (tmp_path / "my_sync_agent.py").write_text(SYNC_AGENT_MODULE)
    proc = _run(tmp_path, "agent=my_sync_agent:solve", "run.progress=false")
    assert proc.returncode == 0, proc.stderr
    output, _, summary = _outputs(tmp_path)
    validate_generator_output(ROLLOUTS, output)
    assert summary["mean_reward"] == 0.5
    assert summary["agent_calls"] == ROLLOUTS
    assert summary["agent_counts"] == {"replies": ROLLOUTS}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["agent=solver"], "`agent`='solver' is not an agent: give `default` (the embedded calculator-tool agent), "),
        (["agent=no_such_agent_mod:run"], "`agent=no_such_agent_mod:run`: cannot import module 'no_such_agent_mod' "),
        (["agent=command:no-such-agent-binary"], "`agent`: the command 'no-such-agent-binary' is not an executable"),
        (
            ["agent.command=python a.py"],
            "`agent` is a single value, not a section: `agent.command` does not exist; "
            "set `agent=...` (see --help); a command is `agent=command:python my_agent.py`",
        ),
        (
            ["generator.agent=default"],
            "`generator.agent` is SkyRL's key, not taken here: the agent is the top-level key `agent` here",
        ),
        (
            ["agent=default", "chaos.failure_rate=0.2", "chaos.stage=step"],
            "`chaos.stage=step` drills environment faults, and an agent's rollouts have no environment",
        ),
        (
            ["agent=default", "generator.vision_language_generator=true"],
            "`agent` and `generator.vision_language_generator=true` both pick the generator",
        ),
    ],
)
def test_a_bad_agent_setting_is_one_line_and_exit_status_2(capsys, tmp_path, args, message):
    out_dir = tmp_path / "out"
    assert main(["rollout", *args, f"run.output_dir={out_dir}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"skyrl-structured: error: {message}"), line
    assert not out_dir.exists()  # refused before anything ran


def test_help_and_print_config_show_the_agent_key(capsys):
    with pytest.raises(SystemExit):
        main(["rollout", "--help"])
    text = capsys.readouterr().out
    assert "\nagent  A single key at the top level, not a section.\n  agent=null\n" in text
    assert "skyrl-structured rollout agent=default" in text
    assert main(["rollout", "--print-config", "agent=default"]) == 0
    assert "\nagent: default\n" in capsys.readouterr().out


COMMAND_AGENT = textwrap.dedent(
    """
    import json, os
    import openai

    client = openai.OpenAI(max_retries=0, timeout=120.0)  # base URL and key from the environment
    messages = json.loads(os.environ["SKYRL_AGENT_PROMPT"])
    client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
    print(0.75)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_command_agent_written_with_a_space_after_the_colon_runs(tmp_path, backend):
    """``agent=command: python my_agent.py`` is YAML for a mapping; it is the command line all the same (issue 38)."""
    (tmp_path / "my_agent.py").write_text(COMMAND_AGENT)
    agent = f"command: {sys.executable} my_agent.py"
    proc = _run(tmp_path, f"agent={agent}", f"run.backend={backend}", "run.progress=false")
    assert proc.returncode == 0, proc.stderr
    output, _, summary = _outputs(tmp_path)
    validate_generator_output(ROLLOUTS, output)
    assert summary["agent"] == agent
    assert summary["mean_reward"] == 0.75
    assert summary["agent_calls"] == ROLLOUTS


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_command_python_runs_with_no_python_on_the_callers_path(tmp_path, backend):
    """Issue 47: no virtual environment activated and no ``python`` on PATH (only python3, as on Debian).

    The command's PATH starts with the generator's interpreter directory, and the check made before the
    engine loads looks there too; a command found nowhere is still refused in one line.
    """
    here = os.path.dirname(sys.executable)
    name = "python" if shutil.which("python", path=here) else os.path.basename(sys.executable)
    (tmp_path / "my_agent.py").write_text(COMMAND_AGENT)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty)}
    proc = _run(tmp_path, f"agent=command:{name} my_agent.py", f"run.backend={backend}", "run.progress=false", env=env)
    assert proc.returncode == 0, proc.stderr
    _, _, summary = _outputs(tmp_path)
    assert summary["mean_reward"] == 0.75
    missing = _run(tmp_path, "agent=command:no-such-agent-binary my_agent.py", env=env)
    assert missing.returncode == 2
    (line,) = missing.stderr.splitlines()
    assert line.startswith("skyrl-structured: error: `agent`: the command 'no-such-agent-binary' is not an executable")


@pytest.mark.parametrize(
    ("value", "agent"),
    [
        ("command: python my_agent.py --steps 3", "command: python my_agent.py --steps 3"),
        ("{command: python my_agent.py}", "command: python my_agent.py"),
        ("command:python my_agent.py", "command:python my_agent.py"),
        ("null", None),
    ],
)
def test_the_agent_key_keeps_its_text_where_yaml_reads_a_mapping(value, agent):
    assert load_config([f"agent={value}"]).agent == agent


def test_an_agent_mapping_of_more_than_one_entry_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("`agent` takes str or null, got '{a: b, c: d}' (dict)")):
        load_config(["agent={a: b, c: d}"])
    config = tmp_path / "rollout.yaml"
    config.write_text("agent:\n  command: python my_agent.py\n")
    assert load_config([], str(config)).agent == "command: python my_agent.py"
    config.write_text("agent:\n  command: python my_agent.py\n  retries: 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"`agent` (in {config}) takes str or null")):
        load_config([], str(config))
