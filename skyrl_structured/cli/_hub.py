"""Whether a Hugging Face Hub name the engine loads can be had: it is in the cache, or the Hub answers.

transformers, given a name that is not in the cache, asks the Hub for it: where the Hub cannot be
reached it retries for about 50 s, then raises an ``OSError`` whose text is a URL and a link to its
docs (issue 38). :func:`hub_problem` answers the same question in a few seconds, before anything
loads: a cached name passes without a request; otherwise ``HF_HUB_OFFLINE`` refuses it at once,
and a Hub that gives no answer within :data:`PROBE_S` seconds (or knows no such model) refuses it
too. Only an answer that the model exists lets the load go ahead and download it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["MODEL_FILES", "PROBE_S", "TOKENIZER_FILES", "hub_problem"]

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


def _ask_hub(name: str) -> str | None:
    """Why the Hub will not give ``name`` (None: it has it, or answered with an error a load may outlive).

    The request runs in a daemon thread joined under a bound, since the name lookup before it
    (``getaddrinfo``) has no timeout of its own; a thread still waiting is left to the process's exit.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            HfApi().model_info(name, timeout=PROBE_S)
            answer["reason"] = None
        except GatedRepoError:
            answer["reason"] = "it is gated: accept its terms on the Hub, then log in (`hf auth login` or HF_TOKEN)"
        except RepositoryNotFoundError:
            answer["reason"] = (
                "the Hub has no such model, or it is private: check the name, or log in (`hf auth login` or HF_TOKEN)"
            )
        except HfHubHTTPError as exc:  # a 5xx or 429: the Hub is there, and loading retries those
            logger.debug("the Hub answered %s for %r; the load will ask again", exc, name)
            answer["reason"] = None
        except Exception as exc:  # connection refused, DNS failure, timeout: whatever the HTTP client raises
            answer["reason"] = f"unreachable: {type(exc).__name__}: {exc}"

    thread = threading.Thread(target=ask, name=f"Hub probe for {name}", daemon=True)
    thread.start()
    thread.join(PROBE_S + 1.0)
    if thread.is_alive():
        return f"unreachable: no answer within {PROBE_S:g} s"
    reason: str | None = answer.get("reason")
    return reason


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
    reason = _ask_hub(name)
    if reason is None:
        return None
    if reason.startswith("unreachable: "):
        return (
            f"{where}, and the Hub at {constants.ENDPOINT} is {reason}: connect to it, or point HF_HOME at a cache "
            "that holds the model and set HF_HUB_OFFLINE=1, or give a local model directory"
        )
    return f"{where}, and {reason}"
