"""POST /v1/chat/completions: the model's chat template, n choices, whole or streamed as SSE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from titan.engine.outputs import RequestOutput
from titan.server.async_engine import EngineFailed, OutputStream
from titan.server.errors import bad_request
from titan.server.protocol import ChatCompletionRequest, check_context, check_model
from titan.server.serving import (
    INLINE_TOKENIZE_CHARS,
    SSE_DONE,
    Choice,
    ResponseFormatter,
    ServerState,
    TokenTexts,
    choice_index,
    degraded_headers,
    new_id,
    request_priority,
    run_to_completion,
    sse,
    sse_error,
    sse_response,
    submit,
    until_disconnect,
    usage,
    wants_timeline,
)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    arrival_time = time.monotonic()
    engine = state.serving_engine()
    check_model(body.model, [state.model_name])
    body.check()
    priority = request_priority(body.priority, request.headers)
    tokenizer = engine.tokenizer
    messages = body.template_messages()
    try:
        if sum(len(message["content"]) for message in messages) <= INLINE_TOKENIZE_CHARS:
            token_ids = tokenizer.encode_chat(messages)
        else:
            token_ids = await asyncio.to_thread(tokenizer.encode_chat, messages)
    except ValueError as error:  # no template, or the template rejected the conversation
        raise bad_request(f"Cannot apply the chat template: {error}", param="messages") from error
    max_tokens = check_context(len(token_ids), body.requested_max_tokens, engine.max_model_len, "messages")
    choices = [Choice(sample, 0, token_ids, body.sampling_params(max_tokens, body.num_logprobs, sample))
               for sample in range(body.n)]
    request_id = new_id("chatcmpl")
    formatter = ChatFormatter(request_id, int(time.time()), state.model_name,
                              TokenTexts(tokenizer) if body.logprobs else None,
                              wants_timeline(body.titan_timeline, request.headers))

    if body.stream:
        stream = await submit(state, request_id, choices, priority, arrival_time)
        return sse_response(stream_chat(stream, formatter, body, len(token_ids)), stream)

    async def run() -> Response:
        stream = await submit(state, request_id, choices, priority, arrival_time)
        finals = await run_to_completion(stream)
        entries = []
        for index in range(body.n):
            output = finals[index]
            logprobs = None
            if formatter.texts is not None:
                logprobs = {"content": formatter.logprobs(output, 0, len(output.token_ids)), "refusal": None}
            entries.append({"index": index, "message": {"role": "assistant", "content": output.text},
                            "logprobs": logprobs, "finish_reason": output.finish_reason, **formatter.extras(output)})
        completion_tokens = sum(len(output.token_ids) for output in finals.values())
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": formatter.created,
                             "model": state.model_name, "choices": entries,
                             "usage": usage(len(token_ids), completion_tokens)}, headers=degraded_headers(stream))

    return await until_disconnect(request, run())


class ChatFormatter(ResponseFormatter):
    def chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None, include_usage: bool,
              logprobs: list[dict[str, Any]] | None = None, extras: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {
            "id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                         "finish_reason": finish_reason, **(extras or {})}],
        }
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    def logprobs(self, output: RequestOutput, start: int, end: int) -> list[dict[str, Any]]:
        assert self.texts is not None and output.logprobs is not None
        texts = self.texts
        return [
            {"token": texts.text(entry.token_id), "logprob": entry.logprob, "bytes": texts.bytes(entry.token_id),
             "top_logprobs": [{"token": texts.text(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}
                              for token_id, logprob in entry.top]}
            for entry in output.logprobs[start:end]
        ]


async def stream_chat(
    stream: OutputStream, formatter: ChatFormatter, body: ChatCompletionRequest, num_prompt_tokens: int
) -> AsyncIterator[bytes]:
    include_usage = body.include_usage
    tokens_seen = dict.fromkeys(range(body.n), 0)
    completion_tokens = 0
    try:
        for index in range(body.n):
            yield formatter.chunk(index, {"role": "assistant", "content": ""}, None, include_usage)
        async for output in stream:
            index = choice_index(output.request_id)
            start, end = tokens_seen[index], len(output.token_ids)
            tokens_seen[index] = end
            if output.new_text or (formatter.texts is not None and end > start):
                logprobs = formatter.logprobs(output, start, end) if formatter.texts is not None else None
                yield formatter.chunk(index, {"content": output.new_text}, None, include_usage, logprobs)
            if output.finished:
                completion_tokens += end
                yield formatter.chunk(index, {}, output.finish_reason, include_usage, extras=formatter.extras(output))
        if include_usage:
            yield sse({"id": formatter.request_id, "object": "chat.completion.chunk", "created": formatter.created,
                       "model": formatter.model, "choices": [],
                       "usage": usage(num_prompt_tokens, completion_tokens)})
    except EngineFailed as error:
        yield sse_error(error)
    finally:
        stream.abort()
    yield SSE_DONE
