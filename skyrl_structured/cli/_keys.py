"""Refusing a key the command does not take: close matches, the full key of a bare name, SkyRL's own keys.

SkyRL keys that live elsewhere here (``trainer.seed`` is ``run.seed``) are looked up first, by exact
key or by prefix, before close-match suggestions, which would point at a look-alike.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from ..keys import close_siblings, did_you_mean, look_alikes, same_name, siblings
from ._schema import ENV_SECTIONS, SECTIONS, KeySpec, key_specs
from ._values import ConfigError

__all__ = ["unknown_key"]

#: Sections of SkyRL's config that a rollout never reads, with what to do instead.
_FOREIGN_SECTIONS = {
    "trainer": "trainer.* configures SkyRL's trainer; `skyrl-structured rollout` runs one generation step only",
}

_ENGINE_ARGS_HINT = (
    "SkyRL's inference-engine settings are not read here; with `engine.kind=vllm` pass vLLM engine "
    "arguments as `engine.engine_args={{{name}: ...}}`"
)

#: SkyRL keys the command does not take, by exact key or by prefix (ending in "."), with where the
#: setting lives here. Looked up before close-match suggestions, which would point at a look-alike.
_SKYRL_HINTS: dict[str, str] = {
    "trainer.policy.model.path": "the model is `engine.model` here (a Hugging Face name or local path; with "
    "engine.kind=http the name the servers serve)",
    "trainer.seed": "the seed is `run.seed` here",
    "generator.inference_engine.backend": "SkyRL's inference backend (vllm) is chosen with `engine.kind` here "
    "(transformers, http or vllm); `run.backend` is something else: the event loop (asyncio or trio)",
    "generator.inference_engine.model_dtype": "the dtype is `engine.dtype` here (transformers engine)",
    "generator.inference_engine.external_server_urls": "servers already running are `engine.base_urls` with "
    "`engine.kind=http` here",
    "generator.inference_engine.external_proxy_url": "servers already running are `engine.base_urls` with "
    "`engine.kind=http` here",
    "generator.inference_engine.served_model_name": "with `engine.kind=http`, `engine.model` is the served name",
    "generator.inference_engine.engine_init_kwargs": "vLLM engine arguments are `engine.engine_args` here",
    "generator.inference_engine.": _ENGINE_ARGS_HINT,
    "generator.agent": "the agent is the top-level key `agent` here (`agent=default`, `agent=module.path:function`, "
    "`agent=command:<command line>`); SkyRL's trainer reads it as generator.agent",
    "data.dataloader.": "the command reads the data files itself; there is no dataloader to configure",
    "environment.skyrl_gym.": "SkyRL's per-environment sections are "
    + ", ".join(f"`environment.skyrl_gym.{name}.*`" for name in ENV_SECTIONS)
    + "; your own environment's settings go in `environment.skyrl_gym.env_configs={{{name}: {{key: value}}}}`",
}


def _skyrl_hint(key: str, *, exact: bool) -> str | None:
    if exact:
        return _SKYRL_HINTS.get(key)
    prefixes = sorted((p for p in _SKYRL_HINTS if p.endswith(".") and key.startswith(p)), key=len, reverse=True)
    if not prefixes:
        return None
    name = key[len(prefixes[0]) :].partition(".")[0]
    if f"{prefixes[0]}{name}" in key_specs():  # a section we do take: its key listing helps more
        return None
    return _SKYRL_HINTS[prefixes[0]].format(name=name)


def unknown_key(key: str, specs: Mapping[str, KeySpec], where: str) -> ConfigError:
    hint_text = _skyrl_hint(key, exact=True)
    if hint_text is not None:
        return ConfigError(f"`{key}`{where} is SkyRL's key, not taken here: {hint_text}")
    head, _, _ = key.partition(".")
    head_spec = specs.get(head)
    if head_spec is not None and head_spec.section is None:  # `agent.command=...`: a top-level single value
        return ConfigError(
            f"`{head}` is a single value, not a section: `{key}`{where} does not exist; set `{head}=...` "
            f"(see --help){_top_key_hint(head)}"
        )
    if head not in SECTIONS:
        foreign = _FOREIGN_SECTIONS.get(head)
        if foreign is not None:
            return ConfigError(f"unknown key `{key}`{where}: {foreign}")
        if "." not in key:
            return _bare_key(key, specs, where)
        # `sampling_params.temperature=1` is a key with its section left out: name the full key.
        close = [p for p in specs if p.endswith(f".{key}")][:2] or difflib.get_close_matches(head, SECTIONS, n=1)
        hint = f"; did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else ""
        return ConfigError(f"unknown section `{head}` in `{key}`{where}{hint} Sections: {', '.join(SECTIONS)}")
    parent = key.rpartition(".")[0]
    parent_spec = specs.get(parent)
    if parent_spec is not None and parent_spec.section is None:
        return ConfigError(f"`{parent}` is a single value, not a section: `{key}`{where} does not exist")
    close = close_siblings(key, specs)
    if not close:  # maybe the right name under another section
        leaves = [p for p, s in specs.items() if s.section is None]
        close = same_name(key, leaves)
        hint_text = None if close else _skyrl_hint(key, exact=False)
        if hint_text is not None:
            return ConfigError(f"unknown key `{key}`{where}: {hint_text}")
        close = close or look_alikes(key, leaves)
    listing = f" Keys under `{parent}`: {', '.join(siblings(key, specs))}" if parent in specs else ""
    return ConfigError(f"unknown key `{key}`{where}{did_you_mean(close)}{listing}")


def _top_key_hint(key: str) -> str:
    return "; a command is `agent=command:python my_agent.py`" if key == "agent" else ""


def _bare_key(key: str, specs: Mapping[str, KeySpec], where: str) -> ConfigError:
    """A key without its section (``maxturns=3``): the full keys whose last name is, or looks like, it."""
    # `max_turns=3` is `generator.max_turns` with its section left out: name the full key.
    close = [p for p in specs if p.endswith(f".{key}")][:2]
    if not close:
        by_name: dict[str, list[str]] = {}
        for path, spec in specs.items():
            if spec.section is None:
                by_name.setdefault(path.rpartition(".")[2], []).append(path)
        names = difflib.get_close_matches(key, list(by_name), n=2, cutoff=0.75)
        close = [path for name in names for path in by_name[name]][:2]
    if not close:
        close = [f"{c}.*" for c in difflib.get_close_matches(key, SECTIONS, n=1)]
    return ConfigError(
        f"unknown key `{key}`{where}: keys are `section.name`{did_you_mean(close)} Sections: {', '.join(SECTIONS)}"
    )
