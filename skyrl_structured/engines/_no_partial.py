"""Which client handed back no partial reply for a cut request, and why: the words of the one INFO line.

A rollout cut in an engine call is parked with what the engine offered
(:func:`~skyrl_structured.engines.partial.offer_partial`); a client that offers nothing is still
correct (the request is sampled again on resume), and the generator says so once. That line names
the client the rollouts called, seen through this package's wrappers (the trio bridge, the test
wrappers), and, for a client known to be unable to offer, the reason.

SkyRL 0.3.0's client is such a one. ``RemoteInferenceClient.generate``
(``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py``) sends each prompt
as one non-streaming ``POST /inference/v1/generate`` (``_generate_single``, through ``_post``) and
reads ``choices[0].token_ids`` only from the finished answer. The cut cancels that await: aiohttp
closes the connection, vLLM aborts the request, and its tokens never reach the client. The one
way its requests answer with their tokens so far (``finish_reason="abort"``) is vLLM's
``/pause?mode=abort`` (``RemoteInferenceClient.pause(mode=PauseMode.ABORT)``), which aborts every
request on every server; SkyRL's vLLM server adds no per-request abort.
"""

from __future__ import annotations

from ._wrapper import EngineWrapper
from .bridge import AsyncioBridge

__all__ = ["innermost_client", "no_partial_reason"]

_SKYRL_CLIENT = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client.RemoteInferenceClient"

#: Clients that cannot hand back a partial reply, by ``module.qualname``: why.
_CANNOT_OFFER: dict[str, str] = {
    _SKYRL_CLIENT: (
        "it sends each request as one non-streaming POST /inference/v1/generate and reads its token ids only from "
        "the finished answer, so a cut request's connection closes, vLLM aborts it and its tokens never arrive"
    ),
}


def innermost_client(client: object) -> object:
    """The client under this package's wrappers (:class:`AsyncioBridge`, :class:`EngineWrapper`)."""
    while True:
        if isinstance(client, AsyncioBridge):
            client = client.client
        elif isinstance(client, EngineWrapper):
            client = client.engine
        else:
            return client


def no_partial_reason(client: object) -> str:
    """``client``'s class name, and why it offered no partial reply where that is known."""
    kind = type(innermost_client(client))
    reason = _CANNOT_OFFER.get(f"{kind.__module__}.{kind.__qualname__}")
    if reason is not None:
        return f"{kind.__name__}: {reason}"
    return f"{kind.__name__} offered none (an engine offers one with skyrl_structured.engines.partial.offer_partial)"
