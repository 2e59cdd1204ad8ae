"""The ``skyrl-structured rollout`` configuration: its sections and the flat table of dotted keys.

``generator.*`` and ``environment.skyrl_gym.*`` are the library's own config dataclasses (SkyRL's
names and defaults); ``environment.env_class``, ``data.*``, ``engine.*``, ``run.*`` and ``chaos.*``
belong to the command. Every field carries a ``help`` text in its metadata; :func:`key_specs`
flattens the tree into one :class:`KeySpec` per settable key, and ``--help`` and the docs'
configuration reference are rendered from that table, so neither can drift from the code.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from skyrl_gym.envs.search.env import SearchEnvConfig
from skyrl_gym.envs.sql.env import Text2SQLEnvConfig

from ..agents import AGENT_VALUES
from ..config import FAILED_ROLLOUT_POLICIES, GeneratorConfig, SkyRLGymConfig

__all__ = [
    "CLI_PRESET",
    "ENV_SECTIONS",
    "SECTIONS",
    "TOP_KEYS",
    "CLISkyRLGymConfig",
    "ChaosSection",
    "DataSection",
    "EngineSection",
    "EnvironmentSection",
    "KeySpec",
    "LLMJudgeEnvConfig",
    "RolloutConfig",
    "RunSection",
    "default_config",
    "describe_type",
    "key_specs",
    "strip_optional",
]

#: Chaos stages (the test kit's): engine stages wrap the engine, env stages the environment, "any" both.
CHAOS_ENGINE_STAGES: tuple[str, ...] = ("generate", "finish_session")
CHAOS_ENV_STAGES: tuple[str, ...] = ("create", "init", "step", "close")


def _opt(text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": text})


def _section(text: str, factory: Any) -> Any:
    return field(default_factory=factory, metadata={"help": text})


@dataclass
class LLMJudgeEnvConfig:
    """SkyRL's ``environment.skyrl_gym.llm_as_a_judge`` section (its example judge environment)."""

    model: str = _opt("llm_as_a_judge: the judge model's name.", "gpt-4o-mini")
    base_url: str | None = _opt("llm_as_a_judge: the judge's OpenAI-compatible base URL; null uses OpenAI's.", None)


@dataclass
class CLISkyRLGymConfig(SkyRLGymConfig):
    """``environment.skyrl_gym`` with SkyRL's per-environment sections, spelled and typed as SkyRL does.

    The environment receives its section as ``env_config``, the way SkyRL's generator passes it
    (``getattr(skyrl_gym_cfg, env_class)``): ``search`` and ``text2sql`` are skyrl_gym's own
    config classes.
    """

    text2sql: Text2SQLEnvConfig = _section("The text2sql environment's settings.", Text2SQLEnvConfig)
    llm_as_a_judge: LLMJudgeEnvConfig = _section("The llm_as_a_judge environment's settings.", LLMJudgeEnvConfig)
    search: SearchEnvConfig = _section("The search environment's settings.", SearchEnvConfig)


#: SkyRL's per-environment sections (attributes of ``environment.skyrl_gym``).
ENV_SECTIONS: tuple[str, ...] = ("text2sql", "llm_as_a_judge", "search")


@dataclass
class EnvironmentSection:
    """SkyRL's ``environment`` section."""

    env_class: str | None = _opt(
        "Environment for dataset rows that have no env_class column (null: gsm8k). Rows that name their "
        "own keep it, as in SkyRL; a value every row overrides is refused.",
        None,
    )
    skyrl_gym: CLISkyRLGymConfig = _section(
        "skyrl_gym settings (worker threads, per-environment config).", CLISkyRLGymConfig
    )


@dataclass
class DataSection:
    """Where the prompts come from."""

    path: str | list[str] | None = _opt(
        "Dataset in SkyRL's format (.jsonl, .json or .parquet; rows with prompt, env_class, reward_spec, "
        "extra_info), or a list of them read in order. null runs the embedded arithmetic word problems.",
        None,
    )
    train_data: list[str] | None = _opt(
        "SkyRL's name: the files read with run.phase=train, in order (instead of data.path).", None
    )
    val_data: list[str] | None = _opt(
        "SkyRL's name: the files read with run.phase=eval, in order (instead of data.path).", None
    )
    max_prompts: int | None = _opt("Use only the first N prompts of the dataset; null uses all of them.", None)


@dataclass
class EngineSection:
    """The inference engine rollouts are generated with."""

    kind: Literal["transformers", "http", "vllm"] = _opt(
        "transformers (Hugging Face generate, CPU or GPU), http (vLLM OpenAI-compatible servers) or "
        "vllm (in-process vLLM).",
        "transformers",
    )
    model: str | None = _opt(
        "Model name or local path (http: the served model name). null with kind=transformers uses the "
        "tiny offline random model.",
        None,
    )
    tokenizer: str | None = _opt("http, vllm: tokenizer name or path, when it is not the model's own.", None)
    base_urls: list[str] = _section(
        "http: base URLs of the vLLM servers; a trajectory sticks to one of them.",
        lambda: ["http://127.0.0.1:8000"],
    )
    timeout_s: float = _opt("http: seconds to wait for one server answer.", 600.0)
    routing: Literal["group_least_loaded", "round_robin"] = _opt(
        "http: where a new trajectory goes among engine.base_urls. group_least_loaded: the trajectories "
        "of one prompt group to one server (its prompt prefilled once there) unless it is past its load "
        "bound, new groups to the least-loaded server by its /metrics; round_robin: the servers in turn.",
        "group_least_loaded",
    )
    device: str | None = _opt(
        "transformers: torch device (cpu, cuda, cuda:1); null leaves the model where it loads (the CPU).", None
    )
    dtype: str | None = _opt("transformers: float32, float16 or bfloat16; null keeps the model's default.", None)
    engine_args: dict[str, Any] = _section(
        "vllm: extra engine arguments, e.g. {gpu_memory_utilization: 0.8, max_model_len: 4096}.", dict
    )


@dataclass
class RunSection:
    """How the command runs."""

    backend: Literal["asyncio", "trio"] = _opt("Event loop the generator runs on.", "asyncio")
    seed: int = _opt(
        "Seed of every request's sampling (generator.sampling_seed, unless set), the engine, the tiny model's "
        "weights and the chaos draws.",
        0,
    )
    output_dir: str = _opt(
        "Directory for generator_output.json, trajectories.jsonl and summary.json (created if missing).",
        "rollout_output",
    )
    phase: Literal["train", "eval"] = _opt(
        "train uses generator.sampling_params and n_samples_per_prompt; eval uses the eval_ ones.", "train"
    )
    progress: bool = _opt("Show the progress bar.", True)
    trace: bool = _opt(
        "Record every rollout's timeline: trace.json (Chrome trace events, open it in Perfetto) and timeline.png.",
        True,
    )
    metrics_port: int | None = _opt(
        "Serve live Prometheus metrics at http://run.metrics_host:PORT/metrics while the step runs (0: any free "
        "port; needs skyrl-structured[prometheus]); null serves none.",
        None,
    )
    metrics_host: str = _opt("Address the metrics server listens on (0.0.0.0: every interface).", "0.0.0.0")
    log_level: Literal["debug", "info", "warning", "error"] = _opt(
        "Library log lines shown on stderr at this level and above.", "warning"
    )


@dataclass
class ChaosSection:
    """Fault drills: make rollouts fail, hang or slow down on purpose, to watch them being contained."""

    failure_rate: float = _opt("Probability that a call at chaos.stage raises.", 0.0)
    hang_rate: float = _opt(
        "Probability that a call at chaos.stage hangs (pair it with generator.rollout_timeout_s).", 0.0
    )
    slow_rate: float = _opt("Probability that a call at chaos.stage is delayed by chaos.slow_s.", 0.0)
    slow_s: float = _opt("Delay of a slowed call, in seconds.", 0.5)
    stage: str = _opt(
        "Where faults are injected: generate or finish_session (the engine), create, init, step or close "
        "(the environment), or any.",
        "generate",
    )
    seed: int | None = _opt("Seed of the fault draws; null uses run.seed.", None)


@dataclass
class RolloutConfig:
    """Everything ``skyrl-structured rollout`` reads."""

    generator: GeneratorConfig = _section(
        "SkyRL's generator section, plus the structured-concurrency knobs.", GeneratorConfig
    )
    environment: EnvironmentSection = _section("SkyRL's environment section.", EnvironmentSection)
    data: DataSection = _section("The prompts.", DataSection)
    engine: EngineSection = _section("The inference engine.", EngineSection)
    run: RunSection = _section("Event loop, seed, output.", RunSection)
    chaos: ChaosSection = _section("Fault drills.", ChaosSection)
    agent: str | None = field(
        default=None,
        metadata={
            "help": "Run an agent that speaks the OpenAI chat API instead of gym rollouts, through "
            f"StructuredAgentGenerator and its capture endpoint: {AGENT_VALUES}. null runs the environments.",
            # `agent=command: python my_agent.py` (a space after the colon) is YAML for a mapping; every
            # agent form is text, so the text is what was meant (issue 38).
            "text": True,
        },
    )


#: Top-level sections, in the order ``--help`` and the docs list them.
SECTIONS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(RolloutConfig)
    if dataclasses.is_dataclass(typing.get_type_hints(RolloutConfig)[f.name])
)
#: Top-level keys that are single values, not sections (``agent=default``).
TOP_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RolloutConfig) if f.name not in SECTIONS)

#: Where the command's defaults differ from the library's (SkyRL's): the embedded default must
#: finish in seconds on two CPU cores with a tiny random model, which rarely emits EOS.
CLI_PRESET: dict[str, Any] = {
    "generator.n_samples_per_prompt": 4,
    "generator.sampling_params.max_generate_length": 48,
}

#: Keys whose values come from a fixed set the field's type does not spell out.
_CHOICES: dict[str, tuple[str, ...]] = {
    "generator.failed_rollout_policy": FAILED_ROLLOUT_POLICIES,
    "generator.chat_template.source": ("name", "file"),
    "chaos.stage": (*CHAOS_ENGINE_STAGES, *CHAOS_ENV_STAGES, "any"),
}


#: Help for the keys of skyrl_gym's own config classes, which carry none.
_FOREIGN_HELP: dict[str, str] = {
    "environment.skyrl_gym.text2sql.db_path": "text2sql: directory holding the SQL databases (SynSQL, spider, bird).",
    "environment.skyrl_gym.search.log_requests": "search: log every retrieval request.",
    "environment.skyrl_gym.search.search_url": "search: URL of the retrieval server the search tool queries.",
    "environment.skyrl_gym.search.topk": "search: passages the retrieval server returns per query.",
    "environment.skyrl_gym.search.timeout": "search: seconds to wait for one retrieval answer.",
}


@dataclass(frozen=True)
class KeySpec:
    """One settable dotted key."""

    path: str
    annotation: Any
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    #: The key is a whole section (a nested dataclass): it takes a mapping, or null when optional.
    section: type | None = None
    optional: bool = False
    #: The library's (SkyRL's) default; differs from ``default`` only where the command's preset does.
    library_default: Any = None
    #: The value is text whatever YAML reads in it: a ``name: value`` that YAML makes a mapping is the
    #: text as typed (``agent=command: python a.py`` is the command line ``python a.py``).
    text: bool = False


def strip_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) == 1:
            return args[0], optional
        return typing.Union[tuple(args)], optional  # noqa: UP007 - rebuilt from parts at runtime
    return annotation, False


def _walk(cls: type, instance: Any, library: Any, prefix: str) -> Iterator[KeySpec]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        annotation, optional = strip_optional(hints[f.name])
        value = getattr(instance, f.name) if instance is not None else None
        lib_value = getattr(library, f.name) if library is not None else None
        text = str(f.metadata.get("help", "")) or _FOREIGN_HELP.get(path, "")
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            yield KeySpec(path, annotation, value, text, section=annotation, optional=optional)
            sub = value if value is not None else annotation()
            sub_lib = lib_value if lib_value is not None else annotation()
            yield from _walk(annotation, sub, sub_lib, f"{path}.")
            continue
        choices = _CHOICES.get(path)
        if choices is None and typing.get_origin(annotation) is Literal:
            choices = tuple(str(a) for a in typing.get_args(annotation))
        yield KeySpec(
            path,
            hints[f.name],
            value,
            text,
            choices=choices,
            optional=optional,
            library_default=lib_value,
            text=bool(f.metadata.get("text", False)),
        )


def default_config() -> RolloutConfig:
    """The command's defaults: the library's, with :data:`CLI_PRESET` applied."""
    cfg = RolloutConfig()
    for path, value in CLI_PRESET.items():
        *parents, name = path.split(".")
        target: Any = cfg
        for part in parents:
            target = getattr(target, part)
        setattr(target, name, value)
    # SkyRL derives the eval defaults from the training length at construction; follow the preset.
    cfg.generator.eval_sampling_params = None
    cfg.generator.__post_init__()
    return cfg


def key_specs() -> dict[str, KeySpec]:
    """Every settable key (sections included), in declaration order."""
    return {spec.path: spec for spec in _walk(RolloutConfig, default_config(), RolloutConfig(), "")}


def describe_type(spec: KeySpec) -> str:
    """A short, user-facing name of what a key accepts."""
    if spec.section is not None:
        return "section" + (" or null" if spec.optional else "")
    if spec.choices is not None:
        return " | ".join(spec.choices)
    annotation, optional = strip_optional(spec.annotation)
    text = _type_name(annotation)
    return f"{text} or null" if optional else text


def _type_name(annotation: Any) -> str:
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    origin = typing.get_origin(annotation)
    if annotation in names:
        return names[annotation]
    if origin is list:
        return "list"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is dict or annotation is dict:
        return "mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    return "value"
