"""Vision features: what a render endpoint returns for images, read back into ``pixel_values`` and ``image_grid_thw``.

vLLM's ``/v1/chat/completions/render`` answers a conversation with its token ids and, when it holds
images, ``features``: per modality the placeholder ranges (``mm_placeholders``), content hashes
(``mm_hashes``) and one serialized processor output per image (``kwargs_data``, base64 strings).
The engine takes ``features`` back unchanged with the token ids; the trainer needs the image
tensors, concatenated over the images of the conversation, as SkyRL's ``decode_mm_kwargs`` builds
them: ``pixel_values`` ``[patches, dim]`` and ``image_grid_thw`` ``[images, 3]``.

An item string is decoded one of two ways:

- ours (:func:`encode_feature_item`): a magic prefix, a JSON header and the raw array bytes, as
  the scripted renderer of :mod:`skyrl_structured.testing` writes it; readable without vLLM;
- vLLM's own serialization, through vLLM's decoder (imported on first use; vLLM must be installed,
  as it is wherever a vLLM render server's features are read, SkyRL's trainer included).

Arrays come back as torch tensors when torch is installed (what SkyRL's trainer concatenates),
numpy arrays otherwise.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import VisionFeatureError

__all__ = [
    "VisionFeatureError",
    "decode_vision_features",
    "empty_rows_like",
    "encode_feature_item",
]

#: The first bytes of an item in our own format (never the start of vLLM's msgpack encoding).
_MAGIC = b"SKYRLS-MM1\x00"

#: Where vLLM's item decoder has lived (SkyRL 0.3.0 imports the first).
_VLLM_DECODERS = (
    "vllm.entrypoints.serve.disagg.mm_serde",
    "vllm.entrypoints.scale_out.token_in_token_out.mm_serde",
)


def encode_feature_item(arrays: Mapping[str, Any]) -> str:
    """One image's processor output (``pixel_values``, ``image_grid_thw``, ...) as a ``kwargs_data`` string.

    Each value is anything ``numpy.asarray`` takes (a torch tensor on CPU included).
    """
    # One header entry per array, in the order their bytes follow.
    header: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, value in arrays.items():
        array = np.ascontiguousarray(np.asarray(value))
        header.append({"name": name, "dtype": array.dtype.str, "shape": list(array.shape), "nbytes": array.nbytes})
        chunks.append(array.tobytes())
    head = json.dumps(header).encode("utf-8")
    raw = _MAGIC + len(head).to_bytes(4, "big") + head + b"".join(chunks)
    return base64.b64encode(raw).decode("ascii")


def _decode_ours(raw: bytes) -> dict[str, np.ndarray]:
    body = raw[len(_MAGIC) :]
    size = int.from_bytes(body[:4], "big")
    header = json.loads(body[4 : 4 + size].decode("utf-8"))
    offset = 4 + size
    out: dict[str, np.ndarray] = {}
    for spec in header:
        end = offset + int(spec["nbytes"])
        if end > len(body):
            raise VisionFeatureError(f"a features item is truncated: `{spec['name']}` needs {spec['nbytes']} bytes")
        array = np.frombuffer(body[offset:end], dtype=np.dtype(spec["dtype"]))
        out[str(spec["name"])] = array.reshape(spec["shape"]).copy()
        offset = end
    return out


def _vllm_decoder() -> Any:
    errors: list[str] = []
    for name in _VLLM_DECODERS:
        try:
            return importlib.import_module(name).decode_mm_kwargs_item
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
    raise VisionFeatureError(
        "the render's `features.kwargs_data` holds vLLM-serialized images, and reading them needs vLLM's "
        f"decoder, which could not be imported ({'; '.join(errors)}); install vLLM where the generator runs: "
        "pip install 'skyrl-structured[vllm]'"
    )


def _decode_item(item: str) -> dict[str, Any]:
    """One ``kwargs_data`` string as {name: array}."""
    if not isinstance(item, str):
        raise VisionFeatureError(
            f"a `features.kwargs_data` item is {type(item).__name__}, expected a base64 string; the render "
            "endpoint must return one string per image"
        )
    try:
        raw = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise VisionFeatureError(f"a `features.kwargs_data` item is not base64 ({exc})") from exc
    if raw.startswith(_MAGIC):
        return dict(_decode_ours(raw))
    data = _vllm_decoder()(item).get_data()
    return dict(data)


def _torch() -> Any | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def _as_backend_array(value: Any, torch: Any | None) -> Any:
    if torch is not None:
        return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    return np.asarray(value)


def decode_vision_features(features: Mapping[str, Any] | None) -> tuple[Any | None, Any | None]:
    """``(pixel_values, image_grid_thw)`` of a render's ``features``; ``(None, None)`` without images.

    Like SkyRL's ``decode_mm_kwargs``: the images' ``pixel_values`` concatenated along the first
    axis, their ``image_grid_thw`` rows stacked (a one-dimensional grid becomes one row).

    Raises:
        VisionFeatureError: an item that is not base64, or in vLLM's format without vLLM installed.
    """
    kwargs_data = (features or {}).get("kwargs_data")
    if not kwargs_data or "image" not in kwargs_data:
        return None, None
    items: Sequence[Any] = kwargs_data["image"] or []
    torch = _torch()
    pixels: list[Any] = []
    grids: list[Any] = []
    for item in items:
        data = _decode_item(item)
        if data.get("pixel_values") is not None:
            pixels.append(_as_backend_array(data["pixel_values"], torch))
        if data.get("image_grid_thw") is not None:
            grid = _as_backend_array(data["image_grid_thw"], torch)
            grids.append(grid.reshape(1, -1) if grid.ndim == 1 else grid)
    concat = torch.cat if torch is not None else np.concatenate
    pixel_values = concat(pixels, 0) if pixels else None
    image_grid_thw = concat(grids, 0) if grids else None
    return pixel_values, image_grid_thw


def empty_rows_like(reference: Any) -> Any:
    """A fresh array with no rows and ``reference``'s other dimensions, dtype and device.

    What a placeholder carries for ``pixel_values`` and ``image_grid_thw``: SkyRL's trainer
    concatenates every row's tensors (``torch.cat`` along the first axis), so an image-free row
    adds nothing, yet every row has a tensor of the right width on the right device.
    """
    shape = (0, *tuple(reference.shape[1:]))
    new_zeros = getattr(reference, "new_zeros", None)
    if callable(new_zeros):
        return new_zeros(shape)
    return np.zeros(shape, dtype=reference.dtype)
