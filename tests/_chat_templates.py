"""Chat templates the token tests share (beyond the built-in ones)."""

from __future__ import annotations

# A custom template unlike ChatML: role names in brackets, a BOS-like prefix, its own generation prompt.
CUSTOM_TEMPLATE = """\
{{- '<|endoftext|>' -}}
{%- for m in messages -%}
{{- '[' ~ m['role'] | upper ~ '] ' ~ m['content'] | trim ~ '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '[ASSISTANT] ' -}}{%- endif -%}"""
