"""A small ChatML tokenizer (and, with torch, a tiny random model) built offline, deterministically.

The tokenizer is a real Hugging Face fast tokenizer: byte-level BPE, so any text encodes without
unknown tokens, with ``<|im_start|>``/``<|im_end|>`` specials and a Qwen2.5-style chat template.
Its merges are learned here from a small embedded corpus by a fixed procedure, so token ids do
not depend on the installed ``tokenizers`` version. It backs the CLI's default run and the tests;
nothing is downloaded.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

__all__ = ["CHATML_TEMPLATE", "build_chatml_tokenizer", "build_tiny_model"]

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = """\
You are a helpful assistant. I am a user. Please solve the problem step by step.
Tom has 3 apples and buys 5 more. How many apples does Tom have now? #### 8
A train travels 60 miles in 2 hours. What is its speed in miles per hour? #### 30
Sara reads 12 pages a day for 7 days. How many pages does she read? #### 84
There are 24 students and 4 teams. How many students are on each team? #### 6
The answer is 42. Let me think about this carefully and check the result.
Please provide your step-by-step reasoning, and also include a tentative numeric answer
at the end in the exact format: '#### ANSWER'. Now provide only the final numeric answer.
<observation>The tool returned an error.</observation> <think> first, then </think>
0 1 2 3 4 5 6 7 8 9 10 11 12 20 30 40 50 60 70 80 90 100 1000 + - * / = ( ) . , ? !
the of and to in is that it for on with as was he she they we you what how many much
"""


def _learn_merges(words: Counter[tuple[str, ...]], count: int) -> list[tuple[str, str]]:
    """Greedy BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair)."""
    merges: list[tuple[str, str]] = []
    current = dict(words)
    for _ in range(count):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in current.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for word, freq in current.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + freq
        current = merged
    return merges


def build_chatml_tokenizer(num_merges: int = 400) -> Any:
    """A ``PreTrainedTokenizerFast`` with a ChatML template; EOS is ``<|im_end|>``, PAD ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words: Counter[tuple[str, ...]] = Counter()
    for line in _CORPUS.splitlines():
        for piece, _ in byte_level.pre_tokenize_str(line + "\n"):
            words[tuple(piece)] += 1
    merges = _learn_merges(words, num_merges)
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges)
    tok = Tokenizer(model)
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    tokenizer: Any,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    init_std: float = 0.02,
    max_positions: int = 4096,
) -> Any:
    """A randomly initialised Llama-architecture causal LM sized to ``tokenizer`` (needs torch).

    The defaults give a head size of 32 (``hidden_size // num_heads``), the smallest that vLLM's
    CPU attention serves, with grouped-query attention (two query heads share one key/value head),
    so the same weights run in :class:`~skyrl_structured.engines.TransformersEngine` and behind a
    real ``vllm serve`` (saved with ``save_pretrained``). ``init_std`` is the weights' standard
    deviation (``initializer_range``): at the default, greedy decoding repeats one token; at 0.2
    the output varies from token to token and sometimes ends with EOS. ``max_positions`` is the
    longest context the config allows (RoPE has no learned positions: the weights do not change).

    Raises:
        ImportError: torch is not installed; the message gives the install command.
    """
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError(
            "build_tiny_model needs PyTorch: pip install 'skyrl-structured[local]' (CPU: pip install torch)"
        ) from exc
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    return model
