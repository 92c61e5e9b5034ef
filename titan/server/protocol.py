"""Request schemas of the OpenAI API (plus vLLM's sampling extensions) and their checks: the fields both
generation routes share and /v1/completions' own (chat's are in chat_protocol.py).

Pydantic catches wrong types (→ 400 via errors.py); `sampling_params` builds the engine's
SamplingParams, whose own range checks become 400s naming the parameter; `check_context` turns a
prompt or `max_tokens` that cannot fit the context into a 400 that names the token counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from titan.engine.sampling_params import MAX_BAD_WORDS, InvalidParameterError, SamplingParams, tokenize_bad_words
from titan.engine.structured import GrammarError, StructuredOutputs
from titan.server.errors import APIError, bad_request
from titan.server.fields import check_extra_fields
from titan.server.limits import INLINE_TOKENIZE_CHARS
from titan.tokenizer import Tokenizer

# Without a limit one request could fan out into thousands of engine sequences.
MAX_N = 128
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused or logged by check_common, never dropped

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these (its other options are refused or logged)."""

    model_config = ConfigDict(populate_by_name=True, extra="allow")

    json_spec: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Numbers are bounded here (finite floats,
    integers within what the engine can hold), so a wild value is a 400 naming its field."""

    # Extra fields are kept so that check_common can refuse or log them (fields.py), never drop them silently.
    model_config = ConfigDict(allow_inf_nan=False, extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    # None: from the X-Titan-Priority class header, else 0
    priority: int | None = Field(default=None, ge=-INT32_MAX - 1, le=INT32_MAX)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob entries name tokens `token_id:N`
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    # vLLM's: keep only the last N prompt tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    skip_special_tokens: bool = True
    # Only requests with the same salt share prefix-cache blocks (a tenant's prompts stay unobservable).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Titan extension: return each choice's timeline (queued, prefill chunks, decode, stalls) when it finishes.
    titan_timeline: bool = False
    # Titan extensions: false opts this request out of the result/semantic caches; true opts into the semantic one.
    titan_cache: bool | None = None
    titan_semantic_cache: bool = False
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's: each choice gets the prompt tokens' logprobs (streamed: first chunk)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputs | None:
        """The one output constraint the request asks for (400 if several), or None."""
        found: list[tuple[str, Any, str]] = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                found.append(("json_object", None, "response_format"))
            else:
                spec = self.response_format.json_schema
                if spec is None or spec.json_schema is None:
                    raise bad_request("response_format of type json_schema needs json_schema.schema",
                                      param="response_format.json_schema")
                found.append(("json", spec.json_schema, "response_format"))
        if self.structured_outputs is not None:
            given = self.structured_outputs
            for kind, value in (("json", given.json_spec), ("regex", given.regex), ("choice", given.choice),
                                ("grammar", given.grammar)):
                if value is not None:
                    found.append((kind, value, f"structured_outputs.{'json' if kind == 'json' else kind}"))
            if given.json_object:
                found.append(("json_object", None, "structured_outputs.json_object"))
        for kind, value, param in (("json", self.guided_json, "guided_json"), ("regex", self.guided_regex,
                                   "guided_regex"), ("choice", self.guided_choice, "guided_choice"),
                                   ("grammar", self.guided_grammar, "guided_grammar")):
            if value is not None:
                found.append((kind, value, param))
        if len(found) > 1:
            raise bad_request("Give one output constraint, not several: " + ", ".join(f[2] for f in found),
                              param=found[1][2])
        if not found:
            return None
        kind, value, param = found[0]
        try:
            return StructuredOutputs.of(kind, value, param)
        except GrammarError as error:
            raise bad_request(str(error), param=error.param) from error

    def logit_bias_ids(self, vocab_size: int | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (token id strings) as token ids, each inside the vocabulary."""
        if not self.logit_bias:
            return None
        biases: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().isdigit() or (vocab_size is not None and int(key) >= vocab_size):
                raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                                  param="logit_bias")
            biases[int(key)] = bias
        return biases

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: the context length), or all of it."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return token_ids[-keep:] if keep and len(token_ids) > keep else token_ids

    def check_common(self) -> None:
        check_extra_fields(self.model_extra)
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be positive, or -1 for the context length",
                              param="truncate_prompt_tokens")
        if self.stream_options is not None:
            check_extra_fields(self.stream_options.model_extra, "stream_options.")
        if self.structured_outputs is not None:
            check_extra_fields(self.structured_outputs.model_extra, "structured_outputs.")
        if self.n < 1 or self.n > MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def bad_words_token_ids(self, tokenizer: Tokenizer) -> list[list[int]] | None:
        """The bad words as token sequences, tokenized here so the engine thread never does it."""
        if not self.bad_words:
            return None
        try:
            return tokenize_bad_words(self.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False))
        except InvalidParameterError as error:
            raise bad_request(str(error), param=error.param) from error

    async def bad_words_token_ids_async(self, tokenizer: Tokenizer) -> list[list[int]] | None:
        """The same, in a worker thread when the words are long enough to hold up the event loop."""
        if sum(len(word) for word in self.bad_words or ()) <= INLINE_TOKENIZE_CHARS:
            return self.bad_words_token_ids(tokenizer)
        return await asyncio.to_thread(self.bad_words_token_ids, tokenizer)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, index: int = 0,
                        vocab_size: int | None = None, prompt_logprobs: int | None = None,
                        defaults: Mapping[str, float] | None = None,
                        bad_words_token_ids: list[list[int]] | None = None) -> SamplingParams:
        """The engine's parameters for choice `index` (seeded choices get seed + index, as vLLM)."""
        if vocab_size is not None:
            check_token_ids(self.stop_token_ids or [], vocab_size, param="stop_token_ids")
            check_token_ids(self.allowed_token_ids or [], vocab_size, param="allowed_token_ids")
        options: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": None if self.seed is None else self.seed + index,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": self.logit_bias_ids(vocab_size),
            # Deduplicated (each id is in the vocabulary): the mask a step builds from it stays vocabulary-sized.
            "allowed_token_ids": None if self.allowed_token_ids is None else sorted(set(self.allowed_token_ids)),
            "bad_words_token_ids": bad_words_token_ids,
            "prompt_logprobs": prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            "structured_outputs": self.structured(),
        }
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}
        # Unset fields take the server's defaults (--generation-config), then SamplingParams' own.
        optional = {name: defaults.get(name) if value is None and defaults else value
                    for name, value in optional.items()}
        options.update({name: value for name, value in optional.items() if value is not None})
        try:
            return SamplingParams(**options)
        except InvalidParameterError as error:
            raise bad_request(str(error), param=error.param) from error


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy endpoint
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: false tokenizes text prompts without a BOS the tokenizer adds

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        for item in prompt:
            if not item:
                raise bad_request("prompt must not contain empty prompts", param="prompt")
        return list(prompt)  # type: ignore[arg-type]

    def check(self) -> None:
        self.check_common()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                              param="max_tokens")

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated."""
        return self.echo and self.max_tokens == 0


def check_context(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str = "prompt",
    kv_cache_tokens: int | None = None,
) -> int:
    """Return the max_tokens to use; 400 if the prompt or prompt + max_tokens exceeds the context. Left unset,
    max_tokens runs to the end of the context, or of the whole KV cache where that is less (llama.cpp's n_ctx;
    filled to the context, every such request was refused by a cache smaller than it)."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens (at least one token must be left for the completion).",
            param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is None:
        room = max_model_len if kv_cache_tokens is None else min(max_model_len, kv_cache_tokens)
        return max(1, room - num_prompt_tokens)  # a prompt the cache cannot hold is refused by the engine
    if max_tokens >= 1 and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded",
        )
    return max_tokens


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param=param)


def check_model(requested: str | None, served_names: list[str]) -> None:
    if requested is not None and requested not in served_names:
        raise APIError(404, f"The model '{requested}' does not exist; this server serves "
                            f"{', '.join(repr(name) for name in served_names)}.",
                       param="model", code="model_not_found")
