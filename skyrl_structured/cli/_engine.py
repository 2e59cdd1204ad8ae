"""The inference engine (and tokenizer) a ``skyrl-structured rollout`` run uses, plus its fault drills.

Engines and the chaos wrappers live in optional parts of the package (``engines``, torch, httpx,
vLLM, ``testing.chaos``); they are imported here, on use, so ``--help`` and configuration checks
work without any of them.

:func:`preflight` checks, before any weights load or rollout starts, what would otherwise fail once
per rollout or only after a long load: the torch device, local model and tokenizer paths, that
every vLLM server is up and serves ``engine.model``, and that a Hub model is cached or downloadable.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from ._schema import CHAOS_ENGINE_STAGES, CHAOS_ENV_STAGES, RolloutConfig
from ._values import ConfigError

__all__ = ["EngineSetup", "chaos_active", "chaos_policy", "load_engine", "preflight", "wrap_env_classes"]


@dataclass
class EngineSetup:
    """A loaded engine (an async context manager, not yet entered), the tokenizer the generator
    uses, a one-line description, and the client the generator calls (the engine, or its chaos
    wrapper)."""

    engine: Any
    tokenizer: Any
    description: str
    client: Any = None

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = self.engine


def chaos_active(cfg: RolloutConfig) -> bool:
    chaos = cfg.chaos
    return chaos.failure_rate > 0 or chaos.hang_rate > 0 or chaos.slow_rate > 0


def _chaos_module() -> Any:
    try:
        return importlib.import_module("skyrl_structured.testing.chaos")
    except ImportError as exc:
        raise ConfigError(f"chaos.* needs skyrl_structured.testing.chaos, which could not be imported: {exc}") from None


def chaos_policy(cfg: RolloutConfig) -> Any | None:
    """The test kit's ``ChaosPolicy`` for ``chaos.*``, or None when no drill is asked for.

    Raises:
        ConfigError: the policy refuses the values (the message is the test kit's own).
    """
    if not chaos_active(cfg):
        return None
    chaos = cfg.chaos
    module = _chaos_module()
    try:
        return module.ChaosPolicy(
            failure_rate=chaos.failure_rate,
            hang_rate=chaos.hang_rate,
            slow_rate=chaos.slow_rate,
            slow_s=chaos.slow_s,
            stage=chaos.stage,
            seed=chaos.seed if chaos.seed is not None else cfg.run.seed,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"chaos.*: {exc}") from None


def wrap_env_classes(env_classes: list[str], policy: Any | None, stage: str) -> list[str]:
    """Environment ids with environment-stage faults injected (unchanged for engine stages)."""
    if policy is None or stage not in (*CHAOS_ENV_STAGES, "any"):
        return env_classes
    register = _chaos_module().register_chaos_env
    wrapped = {name: str(register(name, policy)) for name in sorted(set(env_classes))}
    return [wrapped[name] for name in env_classes]


def _hub_source(name: str, *, tokenizer: bool) -> str:
    """What transformers loads for ``name``: itself, or a cached Hub model's directory when the Hub does not answer."""
    if not _hub_id(name):
        return name
    from ._hub import MODEL_FILES, TOKENIZER_FILES, load_source

    return load_source(name, TOKENIZER_FILES if tokenizer else MODEL_FILES)


def _auto_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # transformers raises OSError/ValueError/HF hub errors alike
        raise RuntimeError(f"could not load tokenizer {name!r}: {exc}") from exc


def load_engine(cfg: RolloutConfig, policy: Any | None) -> EngineSetup:
    """Build the engine ``engine.*`` asks for (blocking: loads weights; run it in a worker thread).

    Raises:
        ImportError: the engine's optional dependencies are missing (the message names the extra).
        RuntimeError: the model or tokenizer could not be loaded.
    """
    e = cfg.engine
    setup: EngineSetup
    engine: Any
    # What the engine uses when a request carries no sampling params (SkyRL's trainer sends none).
    defaults = dataclasses.asdict(cfg.generator.sampling_params)
    if e.kind == "transformers":
        from ..engines import TransformersEngine

        if e.model is None:
            from ..tiny import build_chatml_tokenizer, build_tiny_model

            # As TransformersEngine.tiny(), with run.seed seeding the sampling as well as the weights.
            tokenizer = build_chatml_tokenizer()
            engine = TransformersEngine(
                build_tiny_model(tokenizer, seed=cfg.run.seed),
                tokenizer,
                device=e.device,
                seed=cfg.run.seed,
                default_sampling_params=defaults,
            )
            setup = EngineSetup(engine, tokenizer, "transformers, tiny offline random model")
        else:
            engine = TransformersEngine.from_pretrained(
                _hub_source(e.model, tokenizer=False),
                device=e.device,
                dtype=e.dtype,
                seed=cfg.run.seed,
                default_sampling_params=defaults,
            )
            setup = EngineSetup(engine, engine.tokenizer, f"transformers, {e.model}")
    elif e.kind == "http":
        from ..engines import HTTPEngine

        assert e.model is not None  # checked by check_config
        tokenizer = _auto_tokenizer(_hub_source(e.tokenizer or e.model, tokenizer=True))
        engine = HTTPEngine(
            list(e.base_urls),
            e.model,
            tokenizer=tokenizer,
            timeout_s=e.timeout_s,
            default_sampling_params=defaults,
            routing=e.routing,
        )
        routed = f", {e.routing}" if len(e.base_urls) > 1 else ""
        setup = EngineSetup(engine, tokenizer, f"http, {e.model} at {', '.join(e.base_urls)}{routed}")
    else:
        from ..engines import VLLMEngine

        assert e.model is not None
        tokenizer = _auto_tokenizer(e.tokenizer or e.model)
        args = {"model": e.model, "seed": cfg.run.seed, **e.engine_args}
        if e.tokenizer is not None:
            args.setdefault("tokenizer", e.tokenizer)
        engine = VLLMEngine.from_engine_args(default_sampling_params=defaults, **args)
        setup = EngineSetup(engine, tokenizer, f"vllm, {e.model}")
    if cfg.generator.vision_language_generator and e.kind == "transformers":
        from ..testing.vision import RenderingEngine, ScriptedRenderer

        # A text model has no image processor: the scripted renderer stands in for vLLM's render endpoint.
        setup.client = RenderingEngine(setup.engine, ScriptedRenderer(setup.tokenizer))
        setup.description += ", scripted image renderer"
    if policy is not None and cfg.chaos.stage in (*CHAOS_ENGINE_STAGES, "any"):
        setup.client = _chaos_module().ChaosEngine(setup.client, policy)
    return setup


# A Hugging Face Hub id: "name" or "owner/name", of letters, digits, "-", "_" and ".".
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _hub_id(name: str) -> bool:
    """Whether ``name`` is read as a Hugging Face Hub id: it has a Hub id's shape and is no local path."""
    return bool(_HUB_ID.match(name)) and not name.startswith(".") and not Path(name).expanduser().exists()


def _path_problem(key: str, name: str) -> str | None:
    """A problem when ``name`` is meant as a local directory (it is not a Hub id) that is not a model's."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"`{key}` {name!r} is a file; give the model's directory (the one with config.json)"
        return None
    if _hub_id(name):
        return None  # a Hub id: checked by _hub_problems
    relative = "" if path.is_absolute() else f" (relative to {str(Path.cwd())!r})"
    return (
        f"`{key}` {name!r} looks like a local path but does not exist{relative}; give an existing model "
        "directory or a Hugging Face Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def _device_problem(device: str) -> str | None:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return "`engine.kind=transformers` needs torch: pip install 'skyrl-structured[local]'"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"`engine.device` {device!r} is not a torch device; use cpu, cuda, cuda:N or null"
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            return (
                f"`engine.device={device}` but torch finds no CUDA device (torch {torch.__version__}, {build}); "
                "use engine.device=cpu (or null), or run where a GPU is visible"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            return f"`engine.device={device}` but torch sees {count} CUDA device(s): use cuda:0 to cuda:{count - 1}"
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        return f"`engine.device={device}` but torch finds no MPS device; use engine.device=cpu"
    return None


def _local_problems(cfg: RolloutConfig) -> list[str]:
    e = cfg.engine
    problems: list[str] = []
    if e.kind == "transformers" and e.device is not None:
        problems.append(_device_problem(e.device) or "")
    if e.kind in ("transformers", "vllm") and e.model is not None:
        problems.append(_path_problem("engine.model", e.model) or "")
    if e.kind in ("http", "vllm") and e.tokenizer is not None:
        problems.append(_path_problem("engine.tokenizer", e.tokenizer) or "")
    elif e.kind == "http" and e.model is not None:
        problem = _path_problem("engine.model", e.model)
        if problem is not None:
            problems.append(f"{problem} (it is the tokenizer too, unless `engine.tokenizer` is set)")
    return [p for p in problems if p]


def _hub_problems(cfg: RolloutConfig) -> list[str]:
    """The Hub ids the engine loads (model, tokenizer) that are neither cached nor downloadable (:mod:`._hub`)."""
    from ._hub import MODEL_FILES, TOKENIZER_FILES, hub_problem

    e = cfg.engine
    wanted: list[tuple[str, str, tuple[str, ...], str]] = []
    if e.kind in ("transformers", "vllm") and e.model is not None:
        wanted.append(("engine.model", e.model, MODEL_FILES, ""))
    if e.kind in ("http", "vllm") and e.tokenizer is not None:
        wanted.append(("engine.tokenizer", e.tokenizer, TOKENIZER_FILES, ""))
    elif e.kind == "http" and e.model is not None:
        wanted.append(
            ("engine.model", e.model, TOKENIZER_FILES, " (it is the tokenizer too, unless `engine.tokenizer` is set)")
        )
    problems = []
    for key, name, files, note in wanted:
        problem = hub_problem(key, name, files) if _hub_id(name) else None
        if problem is not None:
            problems.append(problem + note)
    return problems


def _port(url: str) -> str:
    try:
        port = urllib.parse.urlsplit(url).port
    except ValueError:
        port = None
    return str(port) if port is not None else "PORT"


def _serve_command(cfg: RolloutConfig, url: str) -> str:
    """The ``vllm serve`` line that would answer: with ``engine.tokenizer`` given, ``engine.model`` is the
    served name of the model the tokenizer belongs to, so the tokenizer names what to serve."""
    e = cfg.engine
    port = _port(url)
    if e.tokenizer is not None and e.tokenizer != e.model:
        return f"vllm serve {e.tokenizer} --port {port} --served-model-name {e.model}"
    return f"vllm serve {e.model} --port {port}"


def _server_problems(cfg: RolloutConfig) -> list[str]:
    e = cfg.engine
    assert e.model is not None  # checked by check_config
    try:
        from ..engines import HTTPEngine
    except ImportError as exc:
        return [f"`engine.kind=http` needs httpx: pip install 'skyrl-structured[http]' ({exc})"]
    engine = HTTPEngine(list(e.base_urls), e.model, timeout_s=e.timeout_s, connect_timeout_s=min(10.0, e.timeout_s))

    async def probe() -> list[Any]:
        async with engine:
            return await engine.server_status()

    problems = []
    for i, status in enumerate(anyio.run(probe, backend=cfg.run.backend)):
        where = f"{status.url} (engine.base_urls[{i}])"
        if status.problem == "unreachable":
            serve = _serve_command(cfg, status.url)
            problems.append(
                f"no vLLM server answers at {where}: {status.detail}. Start it ({serve}) or fix engine.base_urls"
            )
        elif status.problem == "unhealthy":
            problems.append(
                f"the vLLM server at {where} is not ready: {status.detail}. Wait until it has loaded the model, "
                "or check its log"
            )
        elif status.problem == "model_not_served":
            problems.append(
                f"the vLLM server at {where} does not serve engine.model={e.model!r}: engine.model must be one "
                f"of {list(status.models)}"
            )
    return problems


def preflight(cfg: RolloutConfig) -> list[str]:
    """What would stop the engine from loading or serving, found before any weights load or rollout starts.

    One line per failed check (empty: all passed), each naming the key and the fix: the torch
    device exists (``transformers``), local model and tokenizer paths exist, every server in
    ``engine.base_urls`` is up and serves ``engine.model`` (``http``), and, once all of those
    pass, each Hugging Face Hub id the engine loads is cached or can be downloaded (:mod:`._hub`;
    last, since asking the Hub may take seconds, and a served name is taken for the tokenizer's
    only while ``engine.tokenizer`` is unset: a server problem is the one to fix first).
    """
    problems = _local_problems(cfg)
    if cfg.engine.kind == "http":
        problems += _server_problems(cfg)
    return problems or _hub_problems(cfg)
