"""The typed seams: every client, env handle and tokenizer the package ships fits the protocols it takes.

The tuples below are annotated with the protocols, so ``mypy`` (strict, over ``tests/``) checks each
class's signatures against them: an engine whose ``generate`` or ``finish_session`` drifts from
:class:`~skyrl_structured.InferenceClient` fails the type check, not a run. The tests check the same
at run time, and check SkyRL 0.3.0's own client classes (which ship no type information, so mypy
cannot see them) by signature: the calls the generator makes bind to SkyRL's methods.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from skyrl_structured import AsyncEnvironment, EnvHandle, InferenceClient, RenderingClient
from skyrl_structured.engines import AsyncioBridge, HTTPEngine, TransformersEngine, VLLMEngine
from skyrl_structured.engines._wrapper import EngineWrapper
from skyrl_structured.envs import EnvCallRunner, SyncEnvAdapter
from skyrl_structured.envs._adapters import _AwaitingEnvAdapter
from skyrl_structured.envs._remote import WorkerEnv
from skyrl_structured.testing import ScriptedEngine
from skyrl_structured.testing._matrix import TrappedEngine
from skyrl_structured.testing.chaos import ChaosEngine
from skyrl_structured.testing.leaks import TrackedEngine
from skyrl_structured.testing.vision import RenderingEngine, ScriptedVLMEngine
from skyrl_structured.types import Tokenizer

#: Checked by mypy: each class's instances are InferenceClients.
INFERENCE_CLIENTS: tuple[type[InferenceClient], ...] = (
    HTTPEngine,
    TransformersEngine,
    VLLMEngine,
    AsyncioBridge,
    EngineWrapper,
    ScriptedEngine,
    ScriptedVLMEngine,
    ChaosEngine,
    TrackedEngine,
    TrappedEngine,
    RenderingEngine,
)

#: Checked by mypy: the clients the vision-language generator can render with.
RENDERING_CLIENTS: tuple[type[RenderingClient], ...] = (HTTPEngine, AsyncioBridge, ScriptedVLMEngine, RenderingEngine)

#: Checked by mypy, as far as transformers lets it: a method whose signature conflicts with
#: Tokenizer's fails; a missing one cannot, as its tokenizers answer any attribute (``__getattr__``).
TOKENIZERS: tuple[type[Tokenizer], ...] = (PreTrainedTokenizerBase, TokenizersBackend, SentencePieceBackend)

#: Checked by mypy: what open_env yields, for each way an env can live.
ENV_HANDLES: tuple[type[AsyncEnvironment], ...] = (SyncEnvAdapter, _AwaitingEnvAdapter, WorkerEnv)


@pytest.mark.parametrize("client", INFERENCE_CLIENTS, ids=lambda c: c.__name__)
def test_every_shipped_client_is_an_inference_client(client: type[Any]):
    assert issubclass(client, InferenceClient)
    for name in ("generate", "finish_session"):
        assert inspect.iscoroutinefunction(getattr(client, name)), name


@pytest.mark.parametrize("client", RENDERING_CLIENTS, ids=lambda c: c.__name__)
def test_the_rendering_clients_render(client: type[Any]):
    assert issubclass(client, RenderingClient)
    assert inspect.iscoroutinefunction(client.render_chat_completion)


def test_a_client_without_finish_session_is_not_one():
    class GenerateOnly:
        async def generate(self, input_batch: Any, model: str | None = None) -> Any:
            return {}

    assert not issubclass(GenerateOnly, InferenceClient)
    assert not issubclass(ScriptedEngine, RenderingClient)  # no render_chat_completion


@pytest.mark.parametrize("handle", ENV_HANDLES, ids=lambda c: c.__name__)
def test_every_env_handle_speaks_the_async_protocol(handle: type[Any]):
    assert issubclass(handle, AsyncEnvironment)


def test_a_sync_env_is_wrapped_into_a_handle(ledger):
    import skyrl_gym

    from skyrl_structured.envs._adapters import _wrap
    from skyrl_structured.testing.envs import SCRIPTED_ENV

    raw = skyrl_gym.make(SCRIPTED_ENV, env_config={}, extras={"ledger": ledger})
    handle = _wrap(raw, EnvCallRunner(None))
    assert isinstance(handle, SyncEnvAdapter)
    assert isinstance(handle, AsyncEnvironment)
    assert isinstance(handle, EnvHandle)
    assert not isinstance(raw, AsyncEnvironment)
    raw.close()


def test_the_tokenizers_in_use_are_tokenizers(tokenizer):
    assert isinstance(tokenizer, TOKENIZERS)
    assert isinstance(tokenizer, Tokenizer)
    assert not isinstance(object(), Tokenizer)


# ------------------------------------------------------------------ SkyRL's own clients, by signature


@pytest.fixture(scope="module")
def skyrl_interface() -> type[Any]:
    """SkyRL's ``InferenceEngineInterface``: the abstract base of all its clients, and their signatures.

    (Its ``RemoteInferenceClient`` needs aiohttp, which is not installed here.)
    """
    from ._upstream import load_upstream_generator

    load_upstream_generator()  # registers SkyRL's packages without their heavy __init__ modules
    from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface

    interface: type[Any] = InferenceEngineInterface
    return interface


#: The calls the generator makes on its client, each with the arguments it passes.
_CALLS: dict[str, Callable[[inspect.Signature], inspect.BoundArguments]] = {
    "generate": lambda sig: sig.bind(None, {"prompt_token_ids": [[1]]}, model=None),
    "finish_session": lambda sig: sig.bind(None, "prompt_0"),
    "render_chat_completion": lambda sig: sig.bind(None, {"json": {"model": None, "messages": []}}),
}


def test_skyrls_clients_fit_the_protocols(skyrl_interface):
    assert issubclass(skyrl_interface, InferenceClient)
    assert issubclass(skyrl_interface, RenderingClient)
    for name, call in _CALLS.items():
        method = getattr(skyrl_interface, name)
        assert inspect.iscoroutinefunction(method), name
        call(inspect.signature(method))  # raises TypeError if the generator's call no longer binds


def test_skyrl_types_the_session_id_as_str_as_the_protocol_does(skyrl_interface):
    # Why InferenceClient.finish_session takes a str: a protocol asking for any Hashable would not
    # be met by SkyRL's clients, which accept only str.
    annotation = inspect.signature(skyrl_interface.finish_session).parameters["session_id"].annotation
    assert annotation in (str, "str")
    protocol = inspect.signature(InferenceClient.finish_session).parameters["session_id"].annotation
    assert protocol in (str, "str")
