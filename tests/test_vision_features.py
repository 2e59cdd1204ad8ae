"""Vision features read back from a render: our item format, SkyRL's concatenation, placeholders' empty rows."""

from __future__ import annotations

import base64
import sys

import anyio
import numpy as np
import pytest

from skyrl_structured._episode.images import (
    VisionFeatureError,
    _decode_item,
    decode_vision_features,
    empty_rows_like,
    encode_feature_item,
)
from skyrl_structured.testing import ScriptedVLMEngine, image_part, png_image
from skyrl_structured.testing.vision import png_size


def test_an_item_round_trips_every_array_with_its_dtype_and_shape():
    pixels = np.arange(24, dtype=np.float32).reshape(6, 4)
    grid = np.asarray([1, 2, 3], dtype=np.int64)
    decoded = _decode_item(encode_feature_item({"pixel_values": pixels, "image_grid_thw": grid}))
    assert decoded.keys() == {"pixel_values", "image_grid_thw"}
    np.testing.assert_array_equal(decoded["pixel_values"], pixels)
    assert decoded["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(decoded["image_grid_thw"], grid)
    assert decoded["image_grid_thw"].dtype == np.int64


def test_a_render_decodes_to_the_images_tensors_concatenated(tokenizer):
    torch = pytest.importorskip("torch")
    engine = ScriptedVLMEngine(tokenizer, lambda call: "x")
    first, second = png_image(8, 8, seed=1), png_image(16, 8, seed=2)
    messages = [{"role": "user", "content": [image_part(first), {"type": "text", "text": "and"}, image_part(second)]}]
    rendered = anyio.run(engine.render_chat_completion, {"json": {"messages": messages}})
    pixel_values, grid = decode_vision_features(rendered["features"])
    assert grid is not None
    # 8x8 with 4-pixel patches merged 2x2: a 2x2 grid; 16x8: 2x4.
    assert grid.tolist() == [[1, 2, 2], [1, 2, 4]]
    assert isinstance(pixel_values, torch.Tensor)
    assert pixel_values.shape == (4 + 8, engine.feature_dim)
    placeholders = rendered["features"]["mm_placeholders"]["image"]
    assert [p["length"] for p in placeholders] == [1, 2]
    assert png_size(second) == (16, 8)


def test_no_images_means_no_tensors():
    assert decode_vision_features(None) == (None, None)
    assert decode_vision_features({"kwargs_data": None}) == (None, None)


def test_a_vllm_item_without_vllm_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    item = base64.b64encode(b"\x82\xa4data").decode()
    with pytest.raises(VisionFeatureError, match=r"needs vLLM's decoder.*pip install 'skyrl-structured\[vllm\]'"):
        decode_vision_features({"kwargs_data": {"image": [item]}})
    with pytest.raises(VisionFeatureError, match="not base64"):
        decode_vision_features({"kwargs_data": {"image": ["not base64!"]}})


def test_empty_rows_keep_width_dtype_and_device():
    torch = pytest.importorskip("torch")
    reference = torch.ones(5, 7, dtype=torch.bfloat16)
    empty = empty_rows_like(reference)
    assert empty.shape == (0, 7)
    assert empty.dtype == torch.bfloat16
    assert empty.device == reference.device
    assert empty_rows_like(np.ones((3, 3), dtype=np.int32)).dtype == np.int32
