"""Whether a Hugging Face Hub name the engine loads can be had: it is in the cache, or the Hub answers.

transformers, given a name that is not in the cache, asks the Hub for it: where the Hub cannot be
reached it retries for about 50 s, then raises an ``OSError`` whose text is a URL and a link to its
docs (issue 38). :func:`hub_problem` answers the same question in a few seconds, before anything
loads: a cached name passes without a request; otherwise ``HF_HUB_OFFLINE`` refuses it at once,
and a Hub that gives no answer within :data:`PROBE_S` seconds (or knows no such model) refuses it
too. Only an answer that the model exists lets the load go ahead and download it. A cached name is
loaded from the cache alone when the Hub does not answer (:func:`load_source`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Literal

__all__ = ["MODEL_FILES", "PROBE_S", "TOKENIZER_FILES", "hub_problem", "load_source"]

logger = logging.getLogger(__name__)

#: Seconds the Hub has to answer whether a model exists (it answers in well under one when reachable).
PROBE_S = 5.0
#: A cached model has its ``config.json``; a cached tokenizer its ``tokenizer_config.json``, or the
#: model's ``config.json`` that transformers falls back to.
MODEL_FILES: tuple[str, ...] = ("config.json",)
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer_config.json", "config.json")


def _cached(name: str, files: Sequence[str]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(name, file), str) for file in files)


#: What the Hub said about a name: it can be downloaded ("ok"), the Hub did not answer
#: ("unreachable"), or it answered that it will not give it ("refused"); and why, in words.
_Answer = tuple[Literal["ok", "unreachable", "refused"], str]


def _ask_hub(name: str) -> _Answer:
    """Whether the Hub will give ``name`` (an error a load may outlive, a 5xx or 429, counts as yes).

    The request runs in a daemon thread joined under a bound, since the name lookup before it
    (``getaddrinfo``) has no timeout of its own; a thread still waiting is left to the process's exit.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    answers: list[_Answer] = []

    def ask() -> None:
        try:
            HfApi().model_info(name, timeout=PROBE_S)
            answers.append(("ok", ""))
        except GatedRepoError:
            answers.append(
                ("refused", "it is gated: accept its terms on the Hub, then log in (`hf auth login` or HF_TOKEN)")
            )
        except RepositoryNotFoundError:
            why = "the Hub has no such model, or it is private: check the name, or log in (`hf auth login` or HF_TOKEN)"
            answers.append(("refused", why))
        except HfHubHTTPError as exc:  # a 5xx or 429: the Hub is there, and loading retries those
            logger.debug("the Hub answered %s for %r; the load will ask again", exc, name)
            answers.append(("ok", ""))
        except Exception as exc:  # connection refused, DNS failure, timeout: whatever the HTTP client raises
            answers.append(("unreachable", f"{type(exc).__name__}: {exc}"))

    thread = threading.Thread(target=ask, name=f"Hub probe for {name}", daemon=True)
    thread.start()
    thread.join(PROBE_S + 1.0)
    return answers[0] if answers else ("unreachable", f"no answer within {PROBE_S:g} s")


def hub_problem(key: str, name: str, files: Sequence[str]) -> str | None:
    """A one-line refusal when the Hub id ``name`` (the value of ``key``) can be neither read from the
    cache nor downloaded; None when it is cached, or the Hub says it has it.

    ``files``: what a cached copy holds (:data:`MODEL_FILES` or :data:`TOKENIZER_FILES`). The line
    names the cache directory and ``HF_HUB_OFFLINE``, and the ways out.
    """
    from huggingface_hub import constants, is_offline_mode
    from huggingface_hub.errors import HFValidationError

    try:
        if _cached(name, files):
            return None
    except HFValidationError as exc:
        return f"`{key}` {name!r} is neither a local directory nor a Hugging Face Hub id ({exc})"
    where = f"`{key}` {name!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if is_offline_mode():
        return (
            f"{where} and HF_HUB_OFFLINE=1 forbids downloading it: download it where the Hub is reachable "
            f"(`hf download {name}`) into that cache, point HF_HOME at a cache that holds it, or give a local "
            "model directory"
        )
    answer, why = _ask_hub(name)
    if answer == "ok":
        return None
    if answer == "unreachable":
        return (
            f"{where}, and the Hub at {constants.ENDPOINT} is unreachable: {why}: connect to it, or point HF_HOME at "
            "a cache that holds the model and set HF_HUB_OFFLINE=1, or give a local model directory"
        )
    return f"{where}, and {why}"


def load_source(name: str, files: Sequence[str]) -> str:
    """What to load for the Hub id ``name``: the name, or its cached copy's directory when the Hub does not answer.

    Unless ``HF_HUB_OFFLINE`` is set, transformers asks the Hub about each file of a cached model too,
    and retries each for seconds when nothing answers: a cached tiny model took 2 min 21 s to load
    with the Hub unreachable. So a cached name is loaded from its snapshot directory, with one
    warning, when the Hub gives no answer within :data:`PROBE_S` seconds.
    """
    from huggingface_hub import constants, is_offline_mode, snapshot_download

    if is_offline_mode() or not _cached(name, files):
        return name  # offline, transformers reads the cache alone; not cached, the pre-flight saw the Hub answer
    answer, why = _ask_hub(name)
    if answer != "unreachable":
        return name
    folder = str(snapshot_download(name, local_files_only=True))
    logger.warning(
        "the Hugging Face Hub at %s is unreachable (%s): loading %r from the cache only (%s); set HF_HUB_OFFLINE=1 "
        "to skip asking",
        constants.ENDPOINT,
        why,
        name,
        folder,
    )
    return folder
