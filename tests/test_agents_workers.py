"""Capture endpoint worker processes (``generator.agent_endpoint_workers``, issue 46, DESIGN rule 27).

Real worker processes, real HTTP on 127.0.0.1, the official clients, a real tokenizer. The rows are
the in-loop endpoint's; a rollout's sessions stay on one worker; a killed worker fails only its
rollouts and is replaced; a cancelled ``generate()`` answers 499; no worker outlives the generator
or the trainer's process.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anthropic
import anyio
import openai
import pytest

from skyrl_structured.agents import AgentContext, CaptureSession, StructuredAgentGenerator
from skyrl_structured.agents._pool_start import resolve_workers, start_pool
from skyrl_structured.config import AgentEndpointSettings
from skyrl_structured.errors import CaptureWorkerError
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.validate import validate_generator_output
from tests._agents import Held, assert_rollout_ended, batch, chat, client, in_thread, port_of, row
from tests._pids import alive, gone_within_bound

pytestmark = pytest.mark.anyio

#: The fields of a GeneratorOutput the rows are made of.
ROW_FIELDS = ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons", "rollout_logprobs")


def many_apis_agent(tokenizer: Any) -> Any:
    """An agent on every wire API in one session: a chat of two turns and a fork of its first turn, a Responses
    conversation continued by ``previous_response_id``, a completion from token ids, an Anthropic message."""

    async def agent(ctx: AgentContext) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as oa:
            first = await oa.chat.completions.create(model=ctx.model, messages=ctx.prompt)  # type: ignore[arg-type]
            history = [*ctx.prompt, {"role": "assistant", "content": first.choices[0].message.content}]
            for follow_up in ("Sure?", "Why?"):  # the second one forks from the first turn
                messages = [*history, {"role": "user", "content": follow_up}]
                await oa.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
            opening = await oa.responses.create(model=ctx.model, input="Count to two.")
            await oa.responses.create(model=ctx.model, input="And three?", previous_response_id=opening.id)
            ids = tokenizer.encode(f"Once upon {ctx.rollout}", add_special_tokens=False)
            await oa.completions.create(model=ctx.model, prompt=ids, max_tokens=8)
        async with anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0) as an:
            await an.messages.create(model=ctx.model, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        return 1.0

    return agent


def rows_of(out: Any) -> dict[str, Any]:
    metrics = out["rollout_metrics"] or {}
    agent_metrics = {k: v for k, v in metrics.items() if k.startswith("generate/agent_") and "endpoint" not in k}
    return {**{name: out[name] for name in ROW_FIELDS}, "metrics": agent_metrics}


def engine_requests(engine: ScriptedEngine) -> list[tuple[tuple[int, ...], str]]:
    """What the engine was sent (prompts and sampling parameters, seeds included), in a stable order."""
    return sorted((tuple(c.prompt_token_ids), repr(sorted((c.sampling_params or {}).items()))) for c in engine.calls)


@pytest.mark.parametrize("step_wise", [False, True])
async def test_rows_are_the_in_loop_endpoints_on_two_workers(tokenizer, anyio_backend, step_wise):
    outputs, requests = [], []
    for workers in (0, 2):
        engine = ScriptedEngine.from_replies(
            tokenizer, "3", "Yes.", "Because.", "One, two.", "Three.", "there", "Hello"
        )
        generator = StructuredAgentGenerator(
            engine,
            tokenizer,
            many_apis_agent(tokenizer),
            agent_endpoint_workers=workers,
            sampling_seed=7,
            step_wise_trajectories=step_wise,
        )
        try:
            out = await generator.generate(batch(4))
        finally:
            await generator.aclose()
        validate_generator_output(len(out["response_ids"]), out)
        metrics = out["rollout_metrics"] or {}
        assert metrics["generate/agent_endpoint_workers_max"] == workers
        assert metrics["generate/agent_calls"] == 4 * 7
        outputs.append(rows_of(out))
        requests.append(engine_requests(engine))
        assert len(engine.finished_sessions) == 4
    assert outputs[0] == outputs[1]
    assert requests[0] == requests[1]


async def test_a_rollouts_sessions_stay_on_one_worker_and_rollouts_use_both(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    ports: dict[str, list[int]] = {}
    failed: set[str] = set()

    async def agent(ctx: AgentContext) -> float:
        ports.setdefault(ctx.rollout, []).append(port_of(ctx.base_url))
        reply = await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        assert not isinstance(reply, Exception), reply
        if ctx.rollout in ("q0_0", "q5_0") and ctx.rollout not in failed:  # its first attempt fails: retried
            failed.add(ctx.rollout)
            raise RuntimeError("a first attempt that fails")
        return 1.0

    generator = StructuredAgentGenerator(engine, tokenizer, agent, agent_endpoint_workers=2, max_rollout_retries=1)
    try:
        out = await generator.generate(batch(8))
        assert generator._pool is not None
        worker_ports = {w.port for w in generator._pool.workers}
    finally:
        await generator.aclose()
    assert out["stop_reasons"] == ["stop"] * 8
    assert len(ports["q0_0"]) == len(ports["q5_0"]) == 2  # the failed attempt and its retry
    for name, seen in ports.items():
        assert len(set(seen)) == 1, (name, seen)
    assert {seen[0] for seen in ports.values()} == worker_ports
    assert len(worker_ports) == 2


async def test_a_killed_worker_fails_only_its_rollouts_and_is_replaced(tokenizer, anyio_backend):
    held = Held(tokenizer, 4)
    engine = ScriptedEngine(tokenizer, held)
    keys: dict[str, tuple[str, str]] = {}

    async def agent(ctx: AgentContext) -> float:
        keys[ctx.rollout] = (ctx.base_url, ctx.api_key)
        reply = await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        return 1.0 if not isinstance(reply, Exception) else 0.5

    generator = StructuredAgentGenerator(
        engine, tokenizer, agent, agent_endpoint_workers=2, skip_failed_rollouts=True, failure_budget_action="warn"
    )
    try:
        async with generator.serving():
            pool = generator._pool
            assert pool is not None
            first_pids = pool.pids()
            result: dict[str, Any] = {}

            async def run() -> None:
                result["out"] = await generator.generate(batch(4))

            async with anyio.create_task_group() as group:
                group.start_soon(run)
                await held.all_entered()
                victim = pool.workers[port_of(keys["q0_0"][0]) != pool.workers[0].port]
                lost = {name for name, (url, _) in keys.items() if port_of(url) == victim.port}
                assert victim.pid is not None
                os.kill(victim.pid, signal.SIGKILL)
                with anyio.fail_after(60):  # a hang bound: the death is seen and every lost session fails
                    while pool.sessions_lost < len(lost):  # noqa: ASYNC110 - a thread's count, no event
                        await anyio.sleep(0.01)
                held.release.set()
            out = result["out"]
            for r in range(4):
                if f"q{r}_0" in lost:
                    assert row(out, r)["stop"] == "rollout_error"
                else:
                    assert row(out, r)["stop"] == "stop"
                    assert row(out, r)["reward"][-1] == 1.0
            metrics = out["rollout_metrics"] or {}
            assert metrics["generate/failures/CaptureWorkerError"] == len(lost) > 0
            assert metrics["generate/agent_endpoint_worker_deaths"] == 1
            assert metrics["generate/agent_endpoint_sessions_lost"] == len(lost)
            # A late request with a lost key: the ended session's 404, from the tombstone or the replacement.
            name = sorted(lost)[0]
            assert_rollout_ended(await chat(*keys[name], messages=[{"role": "user", "content": "late"}]), name)
            with anyio.fail_after(60):  # the replacement on the same port gets ready
                while pool.workers[victim.index].pid is None:  # noqa: ASYNC110 - a thread's flag, no event
                    await anyio.sleep(0.01)
            replacement = pool.workers[victim.index]
            assert replacement is not victim
            assert replacement.port == victim.port
            assert_rollout_ended(await chat(*keys[name], messages=[{"role": "user", "content": "later"}]), name)
            again = await generator.generate(batch(4))  # the replacement serves
            assert again["stop_reasons"] == ["stop"] * 4
        every = set(first_pids) | set(pool.pids())
    finally:
        await generator.aclose()
    await gone_within_bound(sorted(every))


async def test_a_cancelled_generate_answers_499_and_closes_every_session_once(tokenizer, anyio_backend):
    held = Held(tokenizer, 3)
    engine = ScriptedEngine(tokenizer, held)
    sessions: list[CaptureSession] = []
    statuses: list[int] = []
    lock = threading.Lock()

    def agent(ctx: AgentContext) -> float:  # a sync agent: its thread sees the answer of its request
        sessions.append(ctx.session)
        try:
            with client(ctx.base_url, ctx.api_key) as c:
                c.chat.completions.create(model="m", messages=ctx.prompt)  # type: ignore[arg-type]
        except openai.APIStatusError as exc:
            with lock:
                statuses.append(exc.status_code)
        return 1.0

    generator = StructuredAgentGenerator(engine, tokenizer, agent, agent_endpoint_workers=1)
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(generator.generate, batch(3))
                await held.all_entered()
                scope.cancel()
        assert scope.cancelled_caught
        with anyio.fail_after(30):  # a hang bound: each agent's thread gets its answer
            while len(statuses) < 3:  # noqa: ASYNC110 - threads' answers, no event
                await anyio.sleep(0.01)
    finally:
        await generator.aclose()
    assert statuses == [499, 499, 499]
    assert [s.closes for s in sessions] == [1, 1, 1]
    assert all(s.close_reason == "cancelled" for s in sessions)


@pytest.mark.parametrize("value", ["auto", 0, 3])
def test_the_knob_takes_auto_zero_or_a_count(value):
    assert AgentEndpointSettings(agent_endpoint_workers=value).agent_endpoint_workers == value


@pytest.mark.parametrize("value", [True, 1.5, "two", -1])
def test_the_knob_refuses_anything_else_in_one_line(tokenizer, value):
    with pytest.raises(ValueError, match=r"^`generator.agent_endpoint_workers` must be \"auto\", 0 ") as caught:
        StructuredAgentGenerator(
            ScriptedEngine.from_replies(tokenizer, "x"), tokenizer, lambda ctx: 1.0, agent_endpoint_workers=value
        )
    assert "\n" not in str(caught.value)


def test_workers_need_one_port_each():
    with pytest.raises(ValueError, match=r"agent_endpoint_workers=2 needs one port per worker.*put \{port\} in it"):
        AgentEndpointSettings(agent_endpoint_workers=2, agent_endpoint_url="http://10.0.0.5:8000")
    with pytest.raises(ValueError, match=r"binds ports 65535..65536"):
        AgentEndpointSettings(agent_endpoint_workers=2, agent_endpoint_port=65535)
    fixed = AgentEndpointSettings(agent_endpoint_workers=2, agent_endpoint_url="http://10.0.0.5:{port}")
    assert resolve_workers(fixed) == (2, "agent_endpoint_workers=2")
    count, why = resolve_workers(AgentEndpointSettings(agent_endpoint_url="http://10.0.0.5:8000"), cores=16)
    assert count == 0
    assert "names one port" in why


@pytest.mark.parametrize(("cores", "workers"), [(1, 0), (2, 1), (3, 2), (16, 8), (64, 8)])
def test_auto_is_one_worker_per_core_beyond_the_first_at_most_eight(cores, workers):
    assert resolve_workers(AgentEndpointSettings(), cores=cores)[0] == workers


class Unpicklable:
    """A tokenizer that cannot cross to a worker process."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def __reduce__(self) -> Any:
        raise pickle.PicklingError("holds a lock")


async def test_a_tokenizer_that_cannot_cross_serves_in_loop_or_is_refused(tokenizer, anyio_backend):
    odd = Unpicklable(tokenizer)
    assert await start_pool(AgentEndpointSettings(), odd, "m", None) is None  # auto: in-loop, said at INFO
    with pytest.raises(ValueError, match=r"agent_endpoint_workers=1 cannot start: .*set agent_endpoint_workers=0$"):
        await start_pool(AgentEndpointSettings(agent_endpoint_workers=1), odd, "m", None)


TRAINER = textwrap.dedent(
    """
    import sys
    import anyio
    from skyrl_structured.agents import StructuredAgentGenerator
    from skyrl_structured.testing import ScriptedEngine
    from skyrl_structured.tiny import build_chatml_tokenizer

    async def main():
        tokenizer = build_chatml_tokenizer()
        generator = StructuredAgentGenerator(
            ScriptedEngine.from_replies(tokenizer, "x"), tokenizer, lambda ctx: 1.0, agent_endpoint_workers=2
        )
        async with generator.serving():
            with open(sys.argv[1] + ".tmp", "w") as f:
                f.write(" ".join(map(str, generator._pool.pids())))
            import os
            os.rename(sys.argv[1] + ".tmp", sys.argv[1])
            await anyio.sleep_forever()

    anyio.run(main)
    """
)


async def test_no_worker_outlives_a_killed_trainer(tmp_path: Path, anyio_backend):
    script, pidfile = tmp_path / "trainer.py", tmp_path / "pids"
    script.write_text(TRAINER, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen([sys.executable, str(script), str(pidfile)], env=env)  # noqa: ASYNC220
    try:
        with anyio.fail_after(120):  # a hang bound: the trainer starts its workers
            while not pidfile.exists():  # another process's file: no event tells
                assert trainer.poll() is None, "the trainer exited"
                await anyio.sleep(0.05)
        pids = [int(p) for p in pidfile.read_text().split()]
        assert len(pids) == 4  # two workers and their guardians
        assert all(alive(p) for p in pids)
    finally:
        trainer.kill()
        trainer.wait()
    await gone_within_bound(pids)


async def test_a_worker_death_before_any_attachment_is_told(tokenizer, anyio_backend):
    """The pool's error names the worker, its pid, its port and the signal."""
    generator = StructuredAgentGenerator(
        ScriptedEngine.from_replies(tokenizer, "x"), tokenizer, lambda ctx: 1.0, agent_endpoint_workers=1
    )
    try:
        async with generator.serving():
            pool = generator._pool
            assert pool is not None
            worker = pool.workers[0]
            assert worker.pid is not None
            os.kill(worker.pid, signal.SIGKILL)
            with anyio.fail_after(60):  # a hang bound: the reader sees the EOF
                while worker.death is None:  # noqa: ASYNC110 - a thread's flag, no event
                    await anyio.sleep(0.01)
            assert isinstance(worker.death, CaptureWorkerError)
            message = str(worker.death)
            assert f"capture endpoint worker 0 (pid {worker.pid}, port {worker.port}) died (SIGKILL)" in message
            assert "with 0 session(s) open" in message
    finally:
        await generator.aclose()


async def test_after_generate_a_late_call_hears_its_rollout_ended_from_its_worker(tokenizer, anyio_backend):
    engine = ScriptedEngine.from_replies(tokenizer, "3")
    seen: list[tuple[str, str, str]] = []

    async def agent(ctx: AgentContext) -> float:
        await chat(ctx.base_url, ctx.api_key, messages=ctx.prompt)
        seen.append((ctx.base_url, ctx.api_key, ctx.rollout))
        return 1.0

    generator = StructuredAgentGenerator(engine, tokenizer, agent, agent_endpoint_workers=1)
    try:
        await generator.generate(batch(1))
        ((url, key, name),) = seen
        answer = await in_thread(lambda: client(url, key).chat.completions.create(model="m", messages=[]))
        assert_rollout_ended(answer, name)
    finally:
        await generator.aclose()


UNGUARDED = textwrap.dedent(
    """
    import os
    with open("main_runs", "a") as runs:  # at import: a worker that ran this __main__ would add its own line
        runs.write(f"{os.getpid()}\\n")
    import torch  # a trainer's __main__ imports torch: a worker must never pay for it (nor run the rest)
    import anyio
    import httpx
    from skyrl_structured.agents import StructuredAgentGenerator
    from skyrl_structured.testing import ScriptedEngine
    from skyrl_structured.tiny import build_chatml_tokenizer

    async def agent(ctx):
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{ctx.base_url}/chat/completions",
                headers={"authorization": f"Bearer {ctx.api_key}"},
                json={"model": ctx.model, "messages": ctx.prompt},
            )
        return 1.0 if answer.json()["choices"][0]["message"]["content"] == "4" else 0.0

    tokenizer = build_chatml_tokenizer()
    generator = StructuredAgentGenerator(
        ScriptedEngine.from_replies(tokenizer, "4"), tokenizer, agent, agent_endpoint_workers=1
    )
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    out = anyio.run(generator.generate, {"prompts": prompts, "env_classes": ["agent"] * 2, "env_extras": [{}] * 2})
    print("WORKERS", generator._pool.pids() if generator._pool else None, flush=True)
    anyio.run(generator.aclose)
    print("ROWS", out["stop_reasons"], out["rewards"], out["rollout_metrics"]["generate/agent_endpoint_workers_max"])
    """
)


def test_a_trainer_script_without_a_main_guard_that_imports_torch_runs_once(tmp_path: Path):
    """Workers never run the trainer's ``__main__``: an unguarded script's body runs once; its rows come back."""
    (tmp_path / "train.py").write_text(UNGUARDED, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Each row's reward on its last token (the reply "4" and its end token): the agent was answered.
    assert "ROWS ['stop', 'stop'] [[0.0, 1.0], [0.0, 1.0]] 1" in done.stdout, done.stdout
    assert (tmp_path / "main_runs").read_text().splitlines() == [str(done_pid(tmp_path))]
    workers = done.stdout.split("WORKERS ", 1)[1].splitlines()[0]
    assert workers != "None"


def done_pid(tmp_path: Path) -> int:
    """The one process that ran the script's body (its first line)."""
    return int((tmp_path / "main_runs").read_text().splitlines()[0])
