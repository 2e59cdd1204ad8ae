"""Chat templates: SkyRL's built-in ones and ``generator.chat_template`` read from a name, a string or a file."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ..types import SkyRLConfig

logger = logging.getLogger(__name__)


_MAX_TEMPLATE_BYTES = 1 << 20

# Jinja2 templates with {% generation %} markers, so `return_assistant_tokens_mask` works.
# Rendered text: "<|im_start|>{role}\n{content}<|im_end|>\n" per message; assistant content is
# the generated span.
_QWEN3_KEEP_THINKING = """\
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}{{- m['content'] ~ '<|im_end|>' -}}{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}"""

# Same, but thinking text before '</think>' is dropped from every assistant turn except a final one.
_QWEN3_DROP_THINKING = """\
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}
{%- set text = m['content'] -%}
{%- if '</think>' in text and not (loop.last and messages[-1]['role'] == 'assistant') -%}
{%- set text = text.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- text ~ '<|im_end|>' -}}
{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<|im_start|>' ~ m['role'] ~ '\n' ~ m['content'] ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}"""

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "qwen3_with_thinking": _QWEN3_KEEP_THINKING,
    "qwen3_without_thinking": _QWEN3_DROP_THINKING,
}

_FIELD = "generator.chat_template"


def _read_template_file(path: str) -> str:
    if "\x00" in path:
        raise ValueError(f"`{_FIELD}.name_or_path` contains a NUL byte: {path!r}")
    if os.path.normpath(path).startswith(".."):
        raise ValueError(
            f"`{_FIELD}.name_or_path` {path!r} climbs out of the working directory; "
            "give an absolute path or one below the current directory"
        )
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(resolved):
        raise ValueError(f"`{_FIELD}.name_or_path`: template file {path!r} does not exist")
    if not os.path.isfile(resolved):
        raise ValueError(f"`{_FIELD}.name_or_path`: {path!r} is not a regular file")
    size = os.path.getsize(resolved)
    if size > _MAX_TEMPLATE_BYTES:
        raise ValueError(
            f"`{_FIELD}.name_or_path`: template file {path!r} is {size} bytes; the limit is {_MAX_TEMPLATE_BYTES} bytes"
        )
    with open(resolved, encoding="utf-8") as f:
        return f.read()


def load_custom_chat_template(chat_template_cfg: SkyRLConfig) -> str | None:
    """The Jinja2 template selected by a ``chat_template`` config, or None for the tokenizer's own.

    Accepts SkyRL's ``ChatTemplateConfig``, ours, a mapping, or None.

    Raises:
        ValueError: unknown source or template name, or an unreadable template file.
    """
    if chat_template_cfg is None:
        return None
    if isinstance(chat_template_cfg, Mapping):
        source = chat_template_cfg.get("source", "name")
        name_or_path = chat_template_cfg.get("name_or_path")
    else:
        source = getattr(chat_template_cfg, "source", "name")
        name_or_path = getattr(chat_template_cfg, "name_or_path", None)
    if not source:
        raise ValueError(f"`{_FIELD}.source` is required: 'name' or 'file'")
    if not name_or_path:
        return None
    if source == "name":
        if name_or_path not in BUILTIN_CHAT_TEMPLATES:
            raise ValueError(
                f"`{_FIELD}.name_or_path` {name_or_path!r} is not a built-in template; choose one of "
                f"{', '.join(sorted(BUILTIN_CHAT_TEMPLATES))} or set source='file'"
            )
        return BUILTIN_CHAT_TEMPLATES[name_or_path]
    if source == "file":
        return _read_template_file(str(name_or_path))
    raise ValueError(f"`{_FIELD}.source` must be 'name' or 'file', got {source!r}")


#: Bounds of the rendered-ids memo: entries, and token ids held in all (about 36 bytes each).
