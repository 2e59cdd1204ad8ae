"""The rollout command's trace.json and timeline.png of a fault drill: valid, nested, retries and failures marked."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from .trace_check import children, spans_by_track

pytestmark = pytest.mark.slow

#: 4 prompts x 4 samples: every kind of span and fault shows, at a third of the default run's cost.
ROLLOUTS = 16
SMALL_RUN = "data.max_prompts=4"


def test_the_trace_of_a_chaos_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl_structured",
            "rollout",
            f"run.output_dir={out}",
            "run.progress=false",
            SMALL_RUN,
            "chaos.failure_rate=0.3",
            "generator.skip_failed_rollouts=true",
            "generator.max_rollout_retries=1",
            "generator.rollout_retry_backoff_s=0.01",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert {"trace.json", "timeline.png"} <= set(summary["files"])
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    trace = json.loads((out / "trace.json").read_text())
    tracks = spans_by_track(trace)  # every span well formed, every track's spans nested
    assert sorted(tid for _, tid in tracks) == list(range(ROLLOUTS))
    failures = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["cat"] == "failure"]
    assert {e["name"] for e in failures} == {"ChaosError"}
    assert sum(e["args"]["will_retry"] for e in failures) == summary["rollout_retries"] > 0
    assert sum(not e["args"]["will_retry"] for e in failures) == summary["rollouts_failed"] > 0

    attempts: Counter[int] = Counter()
    for spans in tracks.values():
        (rollout,) = [s for s in spans if s["cat"] == "rollout"]
        assert children(spans, rollout) == [s for s in spans if s is not rollout]  # all inside the rollout
        assert not any(s["args"].get("unfinished") for s in spans)
        tries = [s for s in spans if s["cat"] == "attempt"]
        backoffs = [s for s in spans if s["cat"] == "backoff"]
        assert len(backoffs) == len(tries) - 1  # a backoff before each retry
        assert rollout["args"]["attempts"] == len(tries)
        attempts[len(tries)] += 1
        for attempt in tries:
            inner = [s["name"] for s in children(spans, attempt)]
            assert inner[0] == "env.make"
            assert inner[-2:] == ["env.close", "finish_session"]  # every attempt cleaned up
            assert "engine" in inner
        if rollout["args"]["failed"]:
            assert rollout["args"]["stop_reason"] == "rollout_error"
            assert rollout["args"]["error"].startswith("ChaosError: chaos: injected failure")
            assert tries[-1]["args"]["outcome"] == "failed"
        else:
            assert rollout["args"]["stop_reason"] == "length"
            assert rollout["args"]["response_tokens"] == 48
    assert attempts[2] == summary["rollout_retries"]
    assert sum(attempts.values()) == ROLLOUTS


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def test_metrics_port_serves_live_metrics_while_the_step_runs(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "skyrl_structured",
        "rollout",
        f"run.output_dir={tmp_path / 'out'}",
        "run.progress=false",
        SMALL_RUN,
        "run.metrics_port=0",  # any free port; the command says which
        "run.metrics_host=127.0.0.1",
        "chaos.slow_rate=1.0",  # every engine call waits, so rollouts are seen in flight
        "chaos.slow_s=1.0",
    ]
    scrapes: list[dict[str, float]] = []
    rest: list[str] = []
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        assert proc.stdout is not None
        url = None
        for line in proc.stderr:
            match = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", line)
            if match:
                url = match.group(1)
                break
        assert url is not None, "the command never said where its metrics are"
        reader = threading.Thread(target=lambda: rest.extend(proc.stderr or ()), daemon=True)
        reader.start()
        while proc.poll() is None:
            with contextlib.suppress(OSError):  # the server stops a moment before the process exits
                scrapes.append(_scrape(url))
            time.sleep(0.05)
        stdout = proc.stdout.read()
        reader.join()
    assert proc.returncode == 0, "".join(rest)
    assert re.search(rf"^  rollouts ok\s+{ROLLOUTS}$", stdout, re.MULTILINE), stdout
    assert scrapes, "no scrape succeeded while the step ran"
    assert max(s["skyrl_structured_rollouts_in_flight"] for s in scrapes) > 0
    assert max(s["skyrl_structured_rollouts_started_total"] for s in scrapes) <= ROLLOUTS
    with pytest.raises(OSError, match="Connection refused"):
        _scrape(url)  # the server stopped with the process
    # The final values, which a scraper may never see live, are in the output directory (issue 27).
    from prometheus_client.parser import text_string_to_metric_families

    final = {
        sample.name: sample.value
        for family in text_string_to_metric_families((tmp_path / "out" / "metrics.prom").read_text())
        for sample in family.samples
        if not sample.labels
    }
    assert final["skyrl_structured_rollouts_started_total"] == ROLLOUTS
    assert final["skyrl_structured_rollouts_in_flight"] == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "metrics.prom" in summary["files"]


def test_a_busy_metrics_port_is_named_with_its_knob(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "skyrl_structured",
                "rollout",
                f"run.output_dir={tmp_path / 'out'}",
                "run.progress=false",
                f"run.metrics_port={port}",
                "run.metrics_host=127.0.0.1",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("skyrl-structured: error:")]
    assert errors == [
        f"skyrl-structured: error: cannot serve metrics at 127.0.0.1:{port} (`run.metrics_port`): Address already "
        "in use; choose a free port, or run.metrics_port=0 for any free one"
    ], proc.stderr
    assert "could not start the engine" not in proc.stderr


def test_a_degenerate_panel_is_a_sentence() -> None:
    from skyrl_structured.cli._plots import degenerate_sentences

    said = degenerate_sentences(
        prompt_rewards=[("0", 0.0), ("1", 0.0)],
        rewards=[0.0] * 48,
        turns=[1] * 48,
        response_lengths=[48] * 48,
        rollouts=48,
        max_generate_length=48,
    )
    assert said == {
        "reward": "48 of 48 rollouts: reward 0.0",
        "turns": "48 of 48 rollouts: 1 turn each",
        "length": "48 of 48 rollouts: length 48 = max_generate_length",
    }
    varied = degenerate_sentences(
        prompt_rewards=[("0", 0.0), ("1", 1.0)],
        rewards=[0.0, 1.0, 1.0],
        turns=[1, 2, 2],
        response_lengths=[30, 30, 30],
        rollouts=4,
        max_generate_length=48,
    )
    assert varied == {"reward": None, "turns": None, "length": "3 of 4 rollouts: length 30"}


def test_the_default_run_draws_data_panels_and_says_the_one_value_ones() -> None:
    # The default run's tiny random model: every reply runs to max_generate_length, 1 turn, reward 0.
    from skyrl_structured.cli._plots import SummaryPlot, choose_panels

    default_like = SummaryPlot(
        title="default",
        prompt_rewards=[(str(p), 0.0) for p in range(12)],
        turns=[1] * 48,
        response_lengths=[48] * 48,
        failures={},
        rewards=[0.0] * 48,
        rollouts=48,
        max_generate_length=48,
        seconds=[2.0 + r for r in range(48)],
        prompt_lengths=[87 + (r // 4) * 2 for r in range(48)],
    )
    panels = choose_panels(default_like)
    assert panels.drawn == ("seconds", "prompt")  # data, not sentences
    assert panels.sentences == (
        "48 of 48 rollouts: reward 0.0",
        "48 of 48 rollouts: 1 turn each",
        "48 of 48 rollouts: length 48 = max_generate_length",
        "no failed rollouts",
    )
    chaos_like = SummaryPlot(
        title="chaos",
        prompt_rewards=[("0", 0.0), ("1", 0.5)],
        turns=[1, 2, 1],
        response_lengths=[48, 30, 48],
        failures={"ChaosError": 2},
        rewards=[0.0, 1.0, 0.0],
        rollouts=5,
        max_generate_length=48,
        seconds=[1.0, 2.0, 3.0],
        prompt_lengths=[90, 90, 90],
    )
    varied = choose_panels(chaos_like)
    assert varied.drawn == ("reward", "turns", "length", "failures")  # the step's own figures first, four at most
    assert varied.sentences == ("3 of 5 rollouts: prompt length 90",)
