"""Per-request sampling parameters, validated at construction (names follow OpenAI and vLLM)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan.engine.structured import StructuredOutputs

MAX_REPETITION_PENALTY = 100.0
# Every step checks each bad word against each sequence's output: bounded in number and in length.
MAX_BAD_WORDS = 256
MAX_BAD_WORD_TOKENS = 32


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string that matched
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled position (plus the sampled token)
    # top-N logprobs of each prompt token given the ones before it (vLLM's); such a prompt skips the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias in [-100, 100], added to the logits
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    # vLLM's bad_words: never completed. The engine tokenizes them into bad_words_token_ids (the server does
    # so on the HTTP side): a sequence's last token is banned right after the rest of it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidParameterError(name, f"{name} must be a finite number, got {getattr(self, name)!r}")
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must not exceed max_tokens"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            # Above this, penalized logits overflow float32 (and no real use comes close).
            (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
             f"must be in (0, {MAX_REPETITION_PENALTY:g}]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs", "must be in [0, 20]"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative"),
            (self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "must fit in 64 bits"),
            (not self.logit_bias or all(t >= 0 and math.isfinite(b) and -100 <= b <= 100
                                        for t, b in self.logit_bias.items()),
             "logit_bias", "must map token ids to biases in [-100, 100]"),
            (self.allowed_token_ids is None or (bool(self.allowed_token_ids)
                                                and all(t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids", "must be a non-empty list of token ids"),
            (not self.bad_words_token_ids or all(word and all(t >= 0 for t in word)
                                                 for word in self.bad_words_token_ids),
             "bad_words", "must be non-empty token sequences"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise InvalidParameterError(name, f"{name} {message}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def tokenize_bad_words(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word as the model writes it, alone and after a space (as vLLM bans them), deduplicated."""
    if len(words) > MAX_BAD_WORDS:
        raise InvalidParameterError("bad_words", f"bad_words may hold at most {MAX_BAD_WORDS} words")
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = encode(text)
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidParameterError("bad_words", f"each of bad_words may be at most {MAX_BAD_WORD_TOKENS} "
                                                         "tokens")
            if ids and ids not in sequences:
                sequences.append(ids)
    if not sequences:
        raise InvalidParameterError("bad_words", "bad_words must hold words with text")
    return sequences


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `param` names it (maps to an HTTP 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
