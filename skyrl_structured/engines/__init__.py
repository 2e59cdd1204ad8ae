"""Inference engines: real clients for the generator, all with SkyRL's ``generate``/``finish_session``.

* :class:`TransformersEngine` — Hugging Face ``generate`` on CPU or GPU, in worker threads
  (extra ``local``: torch). ``TransformersEngine.tiny()`` runs offline.
* :class:`HTTPEngine` — one or more ``vllm serve`` servers over HTTP, session-sticky, with
  failover (extra ``http``: httpx).
* :class:`VLLMEngine` — vLLM's in-process async engine (extra ``vllm``; not yet verified on a GPU).
* :mod:`~skyrl_structured.engines.bridge` — asyncio-only clients under trio (extra ``trio``).

Importing this package needs none of the extras: each engine imports its dependency when it is
constructed and raises an ``ImportError`` naming the extra to install if it is missing.
"""

from .bridge import AsyncioBridge as AsyncioBridge
from .bridge import BridgedCallCancelled as BridgedCallCancelled
from .bridge import asyncio_loop as asyncio_loop
from .errors import EngineConnectionError as EngineConnectionError
from .errors import EngineError as EngineError
from .errors import EngineHTTPError as EngineHTTPError
from .errors import EngineResponseError as EngineResponseError
from .errors import EngineTimeoutError as EngineTimeoutError
from .http import HTTPEngine as HTTPEngine
from .http import ServerStatus as ServerStatus
from .load import EngineLoad as EngineLoad
from .load import ReportsLoad as ReportsLoad
from .sampling import SamplingSpec as SamplingSpec
from .transformers import TransformersEngine as TransformersEngine
from .vllm import VLLMEngine as VLLMEngine

__all__ = (
    "AsyncioBridge",
    "BridgedCallCancelled",
    "EngineConnectionError",
    "EngineError",
    "EngineHTTPError",
    "EngineLoad",
    "EngineResponseError",
    "EngineTimeoutError",
    "HTTPEngine",
    "ReportsLoad",
    "SamplingSpec",
    "ServerStatus",
    "TransformersEngine",
    "VLLMEngine",
    "asyncio_loop",
)
