"""The one skeleton both generation routes share: check, tokenize, submit, stream or collect, usage,
abort on disconnect, `[DONE]`. A route (completions.py, chat.py) only says how its prompts become
choices and how its choices look on the wire."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from titan.engine.llm_engine import EngineInfo
from titan.engine.outputs import RequestOutput
from titan.engine.structured import GrammarError
from titan.server.async_engine import EngineFailed, OutputStream
from titan.server.errors import bad_request
from titan.server.gateway import Gateway, RequestPlan, hit_body
from titan.server.protocol import SamplingRequest, check_model
from titan.server.result_cache import replay_chunks
from titan.server.serving import (
    SSE_DONE,
    SSE_HEADERS,
    Choice,
    ServerState,
    TokenIdTexts,
    TokenTexts,
    cached_prompt_tokens,
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
from titan.server.token_ids import TokenIdFields

# Its own logger, set to INFO by --enable-log-requests whatever the global --log-level.
request_logger = logging.getLogger("titan.requests")


@dataclass
class Prepared:
    """A request turned into engine work: its choices and the prompt tokens its usage counts."""

    choices: list[Choice]
    num_prompt_tokens: int


class GenerationRoute(ABC):
    """One POST route's specifics; a new instance serves each request (it may keep per-choice state)."""

    id_prefix: str
    object: str  # of the whole response
    chunk_object: str  # of each streamed chunk
    token_texts: TokenTexts  # token id → text for any logprobs the response carries (set by handle_generation)

    def __init__(self, body: SamplingRequest) -> None:
        self.body = body
        self.texts: TokenTexts | None = None  # `token_texts`, set only when the request asked for logprobs
        self.token_ids: TokenIdFields | None = None  # set when the request asked for return_token_ids

    @abstractmethod
    def num_sequences(self) -> int:
        """Engine sequences this request would create (prompts × n), known before any tokenization."""

    @abstractmethod
    def wants_logprobs(self) -> bool: ...

    @abstractmethod
    async def prepare(self, info: EngineInfo) -> Prepared:
        """Tokenize and check the prompts against the context; 400 for anything that cannot run."""

    def opening(self, prepared: Prepared) -> list[dict[str, Any]]:
        """Streamed choice entries sent before any token (chat's role, completions' echo)."""
        return []

    @abstractmethod
    def delta(self, choice: Choice, output: RequestOutput) -> dict[str, Any] | None:
        """The streamed choice entry for one step's delta; None when the step released nothing."""

    @abstractmethod
    def finish(self, output: RequestOutput) -> dict[str, Any]:
        """The streamed entry that ends a choice (finish_reason set)."""

    @abstractmethod
    def whole(self, choice: Choice, output: RequestOutput) -> dict[str, Any]:
        """The non-streamed choice entry from its final output."""

    def completion_tokens(self, output: RequestOutput) -> int:
        """What a finished choice counts in `usage.completion_tokens`."""
        return output.num_output_tokens

    def shows_tokens(self) -> bool:
        """Whether the generated tokens are part of the response (not so when completions score a prompt)."""
        return True

    def whole_with_ids(self, choice: Choice, output: RequestOutput) -> dict[str, Any]:
        entry = self.whole(choice, output)
        return entry if self.token_ids is None else entry | self.token_ids.whole(choice, output)


async def handle_generation(state: ServerState, route: GenerationRoute, request: Request) -> Response:
    arrival_time = time.monotonic()
    info = state.serving_info()
    body = route.body
    check_model(body.model, [state.model_name])
    body.check()
    gateway: Gateway | None = getattr(request.app.state, "gateway", None)
    if gateway is None and body.titan_semantic_cache:
        raise bad_request("titan_semantic_cache cannot be honoured: this server runs without --semantic-cache.",
                          param="titan_semantic_cache", code="unsupported_parameter")
    input_flags = gateway.admit(request, route, state.model_name, info) if gateway is not None else []
    if route.num_sequences() > state.max_sequences_per_request:
        param = "n" if body.n > 1 else "prompt"
        raise bad_request(f"This request would run {route.num_sequences()} sequences (prompts × n); the limit is "
                          f"{state.max_sequences_per_request} (--max-sequences-per-request).", param=param)
    priority = request_priority(body.priority, request.headers)
    cache_salt = body.cache_salt
    if gateway is not None:
        priority = gateway.priority(request, priority)
        cache_salt = gateway.cache_salt(request, cache_salt)
    route.token_texts = TokenTexts(info.tokenizer)
    if body.return_token_ids:
        route.token_ids = TokenIdFields(chat=route.object == "chat.completion", shows_tokens=route.shows_tokens())
    if route.wants_logprobs():
        route.texts = TokenIdTexts(info.tokenizer) if body.return_tokens_as_token_ids else route.token_texts
    prepared = await route.prepare(info)
    constraint = prepared.choices[0].params.structured_outputs
    if constraint is not None:
        # Compiled here, in a worker thread, before the request reaches the engine: a slow schema delays
        # only its own request, and the engine finds the compiled grammar in the cache.
        try:
            await asyncio.to_thread(info.grammars.compile, constraint)
        except GrammarError as error:
            raise bad_request(str(error), param=error.param) from error
    request_id = new_id(route.id_prefix)
    if state.log_requests:
        params = prepared.choices[0].params
        request_logger.info("request %s: %d choice(s), %d prompt tokens, max_tokens=%s temperature=%g top_p=%g seed=%s "
                    "structured=%s", request_id, len(prepared.choices), prepared.num_prompt_tokens, params.max_tokens,
                    params.temperature, params.top_p, params.seed,
                    params.structured_outputs.kind if params.structured_outputs else None)
    envelope = Envelope(request_id, int(time.time()), state.model_name, route.chunk_object,
                        wants_timeline(body.titan_timeline, request.headers), body.include_usage,
                        body.include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats))
    plan = None
    if gateway is not None:
        plan = await gateway.plan(request, route, prepared, info, state.model_name, input_flags)
        if plan.hit is not None:
            return replay_hit(plan, route, envelope, body.stream)

    if body.stream:
        stream = await submit(state, request_id, prepared.choices, priority, arrival_time, cache_salt)
        response = sse_response(stream_events(route, prepared, stream, envelope, plan), stream)
        response.headers.update(plan.headers() if plan is not None else {})
        return response

    async def run() -> Response:
        stream = await submit(state, request_id, prepared.choices, priority, arrival_time, cache_salt)
        finals = await run_to_completion(stream)
        if plan is not None:
            finals = plan.filter_finals(finals)
        entries = [route.whole_with_ids(choice, finals[choice.index]) | envelope.extras(finals[choice.index])
                   for choice in prepared.choices]
        completion_tokens = sum(route.completion_tokens(output) for output in finals.values())
        used = usage(prepared.num_prompt_tokens, completion_tokens, cached_prompt_tokens(prepared.choices, finals))
        headers = degraded_headers(stream)
        if plan is not None:
            await plan.finish(entries, used, complete=True)
            headers |= plan.headers()
        ids = route.token_ids.response(prepared.choices[0].prompt_token_ids) if route.token_ids is not None else {}
        return JSONResponse({"id": request_id, "object": route.object, "created": envelope.created,
                             "model": envelope.model, "choices": entries, "usage": used} | ids, headers=headers)

    return await until_disconnect(request, run())


@dataclass
class Envelope:
    """What every streamed chunk of one request repeats."""

    request_id: str
    created: int
    model: str
    chunk_object: str
    timeline: bool  # the client asked for `titan_timeline`
    include_usage: bool
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far

    def chunk(self, entry: dict[str, Any], used: dict[str, Any] | None = None,
              top: dict[str, Any] | None = None) -> bytes:
        """One streamed chunk; `top`: fields beside `choices` (chat's prompt_token_ids, on its first chunk)."""
        payload: dict[str, Any] = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                                   "model": self.model, "choices": [entry]} | (top or {})
        if self.include_usage:
            payload["usage"] = used if self.continuous_usage else None
        return sse(payload)

    def extras(self, output: RequestOutput) -> dict[str, Any]:
        """Titan's additions to a finished choice: its timeline (on request) and any degradation applied."""
        fields: dict[str, Any] = {}
        if self.timeline and output.timeline is not None:
            fields["titan_timeline"] = output.timeline
        if output.degradations:
            fields["titan_degraded"] = output.degradations
        return fields


async def stream_events(route: GenerationRoute, prepared: Prepared, stream: OutputStream,
                        envelope: Envelope, plan: RequestPlan | None = None) -> AsyncIterator[bytes]:
    choices = {choice.index: choice for choice in prepared.choices}
    completion_tokens = 0
    generated: dict[int, int] = {}  # per choice, the tokens so far (continuous usage)
    finals: dict[int, RequestOutput] = {}

    ids = route.token_ids

    def so_far() -> dict[str, Any]:
        return usage(prepared.num_prompt_tokens, sum(generated.values()))

    def chunk(entry: dict[str, Any]) -> bytes:
        if ids is None:
            return envelope.chunk(entry, so_far())
        top = ids.response(prepared.choices[0].prompt_token_ids)
        return envelope.chunk(entry | ids.entry(choices[entry["index"]]), so_far(), top)

    try:
        for entry in route.opening(prepared):
            yield chunk(entry)
        async for engine_output in stream:
            choice = choices[choice_index(engine_output.request_id)]
            generated[choice.index] = route.completion_tokens(engine_output)
            # Output guardrails: only released text goes on; a choice cut by a block sends nothing more.
            output = plan.filter_output(choice.index, engine_output) if plan is not None else engine_output
            if output is None:
                continue
            if ids is not None:
                ids.feed(choice, output)
            entry = route.delta(choice, output)
            if entry is not None:
                yield chunk(entry)
            if output.finished:
                finals[choice.index] = output
                completion_tokens += route.completion_tokens(engine_output)
                extras = envelope.extras(output)
                if plan is not None and plan.choice_flags(choice.index):
                    extras["titan_guardrail"] = plan.choice_flags(choice.index)
                yield chunk({"index": choice.index} | route.finish(output) | extras)
                if len(finals) == len(choices):
                    break  # every choice ended (a blocked one may still be running in the engine)
        used = usage(prepared.num_prompt_tokens, completion_tokens, cached_prompt_tokens(prepared.choices, finals))
        if plan is not None and len(finals) == len(choices):
            entries = [route.whole_with_ids(choices[index], finals[index]) for index in sorted(finals)]
            await plan.finish(entries, used, complete=True)
        if envelope.include_usage:
            yield sse({"id": envelope.request_id, "object": envelope.chunk_object, "created": envelope.created,
                       "model": envelope.model, "choices": [], "usage": used})
    except EngineFailed as error:
        yield sse_error(error)
    finally:
        stream.abort()
        if plan is not None:
            plan.charge(usage(prepared.num_prompt_tokens, completion_tokens))  # once: a no-op after finish
    yield SSE_DONE


def replay_hit(plan: RequestPlan, route: GenerationRoute, envelope: Envelope, stream: bool) -> Response:
    """A cached response: the stored choices and usage under a new id, whole or as a normal SSE stream."""
    assert plan.hit is not None
    stored_usage = plan.hit["usage"]
    plan.charge(stored_usage)
    if not stream:
        return Response(hit_body(plan, envelope.request_id, route.object, envelope.created, envelope.model),
                        media_type="application/json", headers=plan.headers())

    async def events() -> AsyncIterator[bytes]:
        for entry in replay_chunks(envelope.chunk_object, plan.hit["choices"]):
            yield envelope.chunk(entry, stored_usage)  # a stored reply: its tokens are all there already
        if envelope.include_usage:
            yield sse({"id": envelope.request_id, "object": envelope.chunk_object, "created": envelope.created,
                       "model": envelope.model, "choices": [], "usage": stored_usage})
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS | plan.headers())
