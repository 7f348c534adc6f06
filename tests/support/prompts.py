"""The prompts the engine tests send."""

from __future__ import annotations

# Mixed lengths (2..~60 tokens) so batches mix short and long prefill.
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a small model that learned to count: one two three",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and punctuation , . ; : ! ?",
    "Attention",
    "Paged attention stores keys and values in fixed-size blocks. Prefill processes the prompt; "
    "decode produces one token at a time. Mixture of experts routes each token to a few experts.",
    "A journey of a thousand miles",
    "Speculative decoding drafts tokens and verifies them in one step.",
    "Large language models predict the next token from the tokens before it. Attention lets every "
    "position look at the positions that came earlier.",
    "Disaggregated serving",
]
SHARED_PREFIX = (
    "Large language models predict the next token from the tokens before it. "
    "Attention lets every position look at the positions that came earlier. "
)
PREFIX_PROMPTS = [SHARED_PREFIX + tail for tail in ("Once upon", "Numbers 7 8", "The lazy dog", "Decode")]

# Longer prompts for the NPU kernels, whose KV blocks hold 128 tokens: 2 to ~470 tokens.
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "Large language models predict the next token from the tokens before it.",
    "Attention lets every position look at the positions that came earlier.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefill processes the prompt; decode produces one token at a time.",
    "Mixture of experts routes each token to a few experts.",
    "Speculative decoding drafts tokens and verifies them in one step.",
    "Disaggregated serving runs prefill and decode on different instances.",
    "Once upon a time there was a small model that learned to count: one two three four five.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and punctuation , . ; : ! ?",
]


def sentences(start: int, count: int) -> str:
    return " ".join(_SENTENCES[(start + i * 5) % len(_SENTENCES)] for i in range(count))


LONG_PROMPTS = ["Attention", "The quick brown fox"] + [
    sentences(s, n) for s, n in ((1, 2), (2, 5), (3, 8), (4, 12), (5, 15), (6, 19))
]
LONG_PREFIX = sentences(7, 13) + " "
LONG_PREFIX_PROMPTS = [LONG_PREFIX + tail for tail in ("Once upon", "Numbers 7 8", "The lazy dog")]
