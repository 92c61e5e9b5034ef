"""What each route answers, as pydantic models for the OpenAPI document (the handlers build plain dicts;
these only describe them, so schema-driven clients and fuzzers can check every response).

Models allow extra fields: Titan adds its own (`titan_timeline`, `titan_degraded`, vLLM's
`prompt_logprobs`) beside OpenAI's, as OpenAI's clients expect a server to.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Open):
    """The legacy completions logprobs: one entry per token (the prompt's first token has no logprob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallFunction(Open):
    name: str
    arguments: str  # JSON text


class ToolCall(Open):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(Open):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(Open):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Open):
    content: list[TokenLogprob] | None
    refusal: str | None


class ChatChoice(Open):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(Open):
    prompt: str


class ModelCard(Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(Open):
    object: Literal["list"]
    data: list[ModelCard]


class Readiness(Open):
    status: str  # ready | loading | draining | failed


class HealthFailure(Open):
    status: Literal["failed"]
    error: str


class VersionInfo(Open):
    version: str
    quantized_kernels: str


class StepList(Open):
    object: Literal["list"]
    data: list[dict[str, Any]]
    ready_time: float | None


SSE = {"text/event-stream": {"schema": {"type": "string", "description": "OpenAI's chunks, then data: [DONE]"}}}


def answers(model: type[BaseModel], description: str = "OK", streams: bool = False) -> dict[int | str, Any]:
    """`responses` entry for a route's 200: `model` as JSON, and SSE too for a route that streams."""
    entry: dict[str, Any] = {"model": model, "description": description}
    if streams:
        entry["content"] = SSE
    return {200: entry}
