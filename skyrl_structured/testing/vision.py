"""Vision-language test kit: small generated images and a scripted engine that renders conversations.

:class:`ScriptedVLMEngine` is a :class:`~skyrl_structured.testing.ScriptedEngine` that also answers
``render_chat_completion`` the way vLLM's ``/v1/chat/completions/render`` does: the chat template
applied to the conversation, each image replaced by a run of image placeholder tokens (one per
``merge x merge`` patches, as Qwen2-VL's processor counts them), and ``features`` holding per image
its placeholder range, a content hash and its processor output (``pixel_values``
``[patches, dim]``, ``image_grid_thw`` ``[1, 3]``). It is not a vision processor: the "pixels"
are a fixed function of the image bytes, so equal images give equal tensors and the test can
check them. Images are PNG data URLs (:func:`png_image`, :func:`image_part`), made without PIL.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._episode.images import encode_feature_item
from ..engines._wrapper import EngineWrapper
from ..types import InferenceClient
from .engines import ScriptedEngine

__all__ = [
    "RenderCall",
    "RenderingEngine",
    "ScriptedRenderer",
    "ScriptedVLMEngine",
    "encode_png",
    "image_part",
    "png_image",
    "png_size",
]

#: Stands in for an image inside the rendered text; a private-use character no template produces.
_IMAGE_MARK = "\ue000"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, pixel: Callable[[int, int], tuple[int, int, int]]) -> bytes:
    """An RGB PNG, ``pixel(x, y)`` giving each pixel's (r, g, b) in 0..255, as bytes (no PIL needed).

    Raises:
        ValueError: a side below 1.
    """
    if width < 1 or height < 1:
        raise ValueError(f"a PNG needs width and height >= 1, got {width}x{height}")
    rows = bytearray()
    for y in range(height):
        rows.append(0)  # filter type: none
        for x in range(width):
            rows += bytes(pixel(x, y))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return _PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(bytes(rows))) + _chunk(b"IEND", b"")


def png_image(width: int, height: int, seed: int = 0) -> bytes:
    """A small RGB PNG whose pixels depend on ``seed`` (a gradient and a square), as bytes.

    Raises:
        ValueError: a side below 1.
    """

    def pixel(x: int, y: int) -> tuple[int, int, int]:
        inside = width // 4 <= x < 3 * width // 4 and height // 4 <= y < 3 * height // 4
        return (x * 37 + seed * 11) % 256, (y * 53 + seed * 29) % 256, 255 if inside else seed % 256

    return encode_png(width, height, pixel)


def png_size(png: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's header.

    Raises:
        ValueError: not a PNG.
    """
    if not png.startswith(_PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise ValueError("not a PNG image (the scripted renderer reads PNG data URLs only)")
    width, height = struct.unpack(">II", png[16:24])
    return int(width), int(height)


def image_part(png: bytes) -> dict[str, Any]:
    """An OpenAI chat content part carrying ``png`` as a data URL (what vLLM's render endpoint takes)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


def _image_bytes(part: Mapping[str, Any]) -> bytes:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str) or not url.startswith("data:image/png;base64,"):
        raise ValueError(
            "the scripted renderer takes images as PNG data URLs (see skyrl_structured.testing.image_part)"
        )
    return base64.b64decode(url.split(",", 1)[1])


@dataclass
class RenderCall:
    """One ``render_chat_completion`` request the engine received."""

    model: str | None
    messages: list[dict[str, Any]]


@dataclass
class ScriptedRenderer:
    """Renders chat conversations with images as vLLM's ``/v1/chat/completions/render`` does (see the module).

    Args:
        tokenizer: applies the chat template and encodes the text around the images.
        patch_size: pixels per patch side; ``merge`` patches a side share one placeholder token.
        feature_dim: the width of ``pixel_values``.
        image_token_id: the placeholder token; defaults to the tokenizer's ``<|image_pad|>``, else its pad token.
    """

    tokenizer: Any
    patch_size: int = 4
    merge: int = 2
    feature_dim: int = 8
    image_token_id: int | None = None
    renders: list[RenderCall] = field(default_factory=list)

    def _image_token(self) -> int:
        if self.image_token_id is None:
            # Looked up once: a tokenizer's get_vocab() builds the whole vocabulary dict.
            token = self.tokenizer.get_vocab().get("<|image_pad|>", self.tokenizer.pad_token_id)
            self.image_token_id = int(token if token is not None else self.tokenizer.eos_token_id)
        return self.image_token_id

    def _image_features(self, png: bytes) -> tuple[int, Any, list[int]]:
        """(placeholder tokens, pixel_values, grid) of one image."""
        width, height = png_size(png)
        side = self.patch_size * self.merge
        grid_h = math.ceil(height / side) * self.merge
        grid_w = math.ceil(width / side) * self.merge
        seed = int.from_bytes(hashlib.blake2b(png, digest_size=8).digest(), "big")
        pixels = np.random.default_rng(seed).standard_normal((grid_h * grid_w, self.feature_dim)).astype(np.float32)
        return grid_h * grid_w // (self.merge * self.merge), pixels, [1, grid_h, grid_w]

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """``{"token_ids": [...], "features": {...} | None}`` for ``request_payload["json"]["messages"]``.

        Raises:
            ValueError: an image that is not a PNG data URL.
        """
        body = request_payload["json"]
        messages: Sequence[Mapping[str, Any]] = body["messages"]
        self.renders.append(RenderCall(body.get("model"), [dict(m) for m in messages]))
        images: list[bytes] = []
        flat: list[dict[str, Any]] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                pieces: list[str] = []
                for part in content:
                    if part.get("type") == "text":
                        pieces.append(str(part.get("text", "")))
                    else:
                        images.append(_image_bytes(part))
                        pieces.append(_IMAGE_MARK)
                content = "".join(pieces)
            flat.append({**message, "content": content})
        text = self.tokenizer.apply_chat_template(
            flat, tokenize=False, add_generation_prompt=bool(body.get("add_generation_prompt", True))
        )
        segments = text.split(_IMAGE_MARK)
        token_ids: list[int] = list(self.tokenizer.encode(segments[0], add_special_tokens=False))
        placeholders: list[dict[str, int]] = []
        hashes: list[str] = []
        items: list[str] = []
        for png, segment in zip(images, segments[1:], strict=True):
            count, pixels, grid = self._image_features(png)
            placeholders.append({"offset": len(token_ids), "length": count})
            token_ids.extend([self._image_token()] * count)
            hashes.append(hashlib.blake2b(png, digest_size=16).hexdigest())
            items.append(encode_feature_item({"pixel_values": pixels, "image_grid_thw": np.asarray(grid)}))
            token_ids.extend(self.tokenizer.encode(segment, add_special_tokens=False))
        if not images:
            return {"token_ids": token_ids, "features": None}
        features = {
            "mm_hashes": {"image": hashes},
            "mm_placeholders": {"image": placeholders},
            "kwargs_data": {"image": items},
        }
        return {"token_ids": token_ids, "features": features}


@dataclass
class ScriptedVLMEngine(ScriptedEngine):
    """A :class:`ScriptedEngine` that also renders conversations with images (vLLM's render endpoint).

    Args (besides :class:`ScriptedEngine`'s):
        model_name: what SkyRL's VLM generator puts in each render request.
        patch_size, merge, feature_dim, image_token_id: the :class:`ScriptedRenderer`'s.
    """

    model_name: str = "scripted-vlm"
    patch_size: int = 4
    merge: int = 2
    feature_dim: int = 8
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        self.renderer = ScriptedRenderer(
            self.tokenizer, self.patch_size, self.merge, self.feature_dim, self.image_token_id
        )

    @property
    def renders(self) -> list[RenderCall]:
        """The render requests received so far."""
        return self.renderer.renders

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        """See :meth:`ScriptedRenderer.render_chat_completion`."""
        return await self.renderer.render_chat_completion(request_payload)


class RenderingEngine(EngineWrapper):
    """Any inference client plus a renderer: ``render_chat_completion`` for clients that have none.

    ``generate`` goes to the wrapped client with the request unchanged; a text-only model ignores the
    ``mm_features`` and sees the image placeholder tokens (what the CLI's offline multimodal default runs).
    """

    def __init__(self, engine: InferenceClient, renderer: Any, *, model_name: str = "scripted-vlm") -> None:
        super().__init__(engine)
        self.renderer = renderer
        self.model_name = model_name

    async def render_chat_completion(self, request_payload: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.renderer.render_chat_completion(request_payload)
        return result
