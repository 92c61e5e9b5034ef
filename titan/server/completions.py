"""POST /v1/completions: prompts (text or token ids) × n choices, whole or streamed as SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from titan.engine.outputs import RequestOutput
from titan.server.async_engine import EngineFailed, OutputStream
from titan.server.protocol import CompletionRequest, check_context, check_model, check_token_ids
from titan.server.serving import (
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
    tokenize,
    until_disconnect,
    usage,
    wants_timeline,
)


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    arrival_time = time.monotonic()
    engine = state.serving_engine()
    check_model(body.model, [state.model_name])
    body.check()
    priority = request_priority(body.priority, request.headers)
    tokenizer = engine.tokenizer
    prompt_ids: list[list[int]] = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            prompt_ids.append(await tokenize(tokenizer, prompt))
        else:
            check_token_ids(prompt, engine.model_config.vocab_size)
            prompt_ids.append(list(prompt))
    choices = []
    for prompt_index, token_ids in enumerate(prompt_ids):
        max_tokens = check_context(len(token_ids), body.max_tokens, engine.max_model_len)
        for sample in range(body.n):
            params = body.sampling_params(max_tokens, body.logprobs, sample)
            choices.append(Choice(prompt_index * body.n + sample, prompt_index, token_ids, params))
    request_id = new_id("cmpl")
    created = int(time.time())
    echoes = [tokenizer.decode(ids) if body.echo else "" for ids in prompt_ids]
    texts = TokenTexts(tokenizer) if body.logprobs is not None else None
    formatter = CompletionFormatter(request_id, created, state.model_name, texts,
                                    wants_timeline(body.titan_timeline, request.headers))

    if body.stream:
        stream = await submit(state, request_id, choices, priority, arrival_time)
        return sse_response(stream_completion(stream, formatter, choices, prompt_ids, echoes, body), stream)

    async def run() -> Response:
        stream = await submit(state, request_id, choices, priority, arrival_time)
        finals = await run_to_completion(stream)
        entries = []
        for choice in choices:
            output = finals[choice.index]
            echo = echoes[choice.prompt_index]
            logprobs = formatter.logprobs(output, 0, len(output.token_ids), len(echo)) if texts else None
            entries.append({"index": choice.index, "text": echo + output.text, "logprobs": logprobs,
                            "finish_reason": output.finish_reason, **formatter.extras(output)})
        completion_tokens = sum(len(output.token_ids) for output in finals.values())
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created,
                             "model": state.model_name, "choices": entries,
                             "usage": usage(sum(len(ids) for ids in prompt_ids), completion_tokens)},
                            headers=degraded_headers(stream))

    return await until_disconnect(request, run())


class CompletionFormatter(ResponseFormatter):
    def chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> bytes:
        payload: dict[str, Any] = {"id": self.request_id, "object": "text_completion", "created": self.created,
                                   "model": self.model, "choices": choices}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    def logprobs(self, output: RequestOutput, start: int, end: int, text_offset: int) -> dict[str, Any]:
        """The legacy completions logprobs object for output tokens [start, end)."""
        assert self.texts is not None and output.logprobs is not None
        text = self.texts.text
        entries = output.logprobs[start:end]
        tokens = [text(entry.token_id) for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{text(token_id): logprob for token_id, logprob in
                              [(entry.token_id, entry.logprob), *entry.top]} for entry in entries],
            "text_offset": offsets,
        }


async def stream_completion(
    stream: OutputStream,
    formatter: CompletionFormatter,
    choices: list[Choice],
    prompt_ids: list[list[int]],
    echoes: list[str],
    body: CompletionRequest,
) -> AsyncIterator[bytes]:
    include_usage = body.include_usage
    tokens_seen = {choice.index: 0 for choice in choices}
    text_offsets = {choice.index: 0 for choice in choices}
    completion_tokens = 0
    try:
        if body.echo:
            for choice in choices:
                echo = echoes[choice.prompt_index]
                text_offsets[choice.index] = len(echo)
                yield formatter.chunk([{"index": choice.index, "text": echo, "logprobs": None,
                                        "finish_reason": None}], include_usage)
        async for output in stream:
            index = choice_index(output.request_id)
            start, end = tokens_seen[index], len(output.token_ids)
            tokens_seen[index] = end
            if output.new_text or (formatter.texts is not None and end > start):
                logprobs = None
                if formatter.texts is not None:
                    logprobs = formatter.logprobs(output, start, end, text_offsets[index])
                text_offsets[index] += len(output.new_text)
                yield formatter.chunk([{"index": index, "text": output.new_text, "logprobs": logprobs,
                                        "finish_reason": None}], include_usage)
            if output.finished:
                completion_tokens += end
                yield formatter.chunk([{"index": index, "text": "", "logprobs": None,
                                        "finish_reason": output.finish_reason, **formatter.extras(output)}],
                                      include_usage)
        if include_usage:
            yield sse({"id": formatter.request_id, "object": "text_completion", "created": formatter.created,
                       "model": formatter.model, "choices": [],
                       "usage": usage(sum(len(ids) for ids in prompt_ids), completion_tokens)})
    except EngineFailed as error:
        yield sse_error(error)
    finally:
        stream.abort()
    yield SSE_DONE
