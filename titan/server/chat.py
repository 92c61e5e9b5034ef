"""POST /v1/chat/completions: the model's chat template, n choices, whole or streamed as SSE."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from titan.engine.llm_engine import EngineInfo
from titan.engine.outputs import RequestOutput
from titan.engine.scheduler_output import TokenLogprobs
from titan.server.chat_prompt import chat_prompt_ids, check_template_reads
from titan.server.chat_protocol import ChatCompletionRequest
from titan.server.errors import bad_request
from titan.server.generation import GenerationRoute, Prepared, handle_generation
from titan.server.limits import INLINE_TOKENIZE_CHARS
from titan.server.protocol import check_context
from titan.server.serving import (
    Choice,
    ServerState,
    TokenTexts,
    choice_index,
    prompt_logprobs_field,
)
from titan.server.tool_stream import ToolCallStream
from titan.server.tools import (
    complete_call,
    constraint_for,
    parse_tool_calls,
    render_conversation,
    template_knows_tools,
)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    return await handle_generation(state, ChatRoute(body, state.tool_call_parser), request)


class ChatRoute(GenerationRoute):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    body: ChatCompletionRequest

    def __init__(self, body: ChatCompletionRequest, tool_call_parser: str) -> None:
        super().__init__(body)
        self.tool_call_parser = tool_call_parser
        self.tools = body.tool_dicts()  # None: no tool calling in this request
        self.tool_choice = body.effective_tool_choice
        self.tool_streams: dict[int, ToolCallStream] = {}  # per streamed choice, when tools are on
        self.started: set[int] = set()  # streamed choices whose first token went by
        # vLLM's echo: a reply that continues an assistant message starts with that message's text.
        last = body.messages[-1]
        self.echo = last.text() if body.echo and last.role == "assistant" else ""

    def num_sequences(self) -> int:
        return self.body.n

    def wants_logprobs(self) -> bool:
        return self.body.logprobs

    async def prepare(self, info: EngineInfo) -> Prepared:
        body = self.body
        tokenizer = info.tokenizer
        native = template_knows_tools(tokenizer.chat_template)
        messages = render_conversation(body.template_messages(), self.tools, native)

        check_template_reads(tokenizer, body)

        def encode() -> list[int]:
            return chat_prompt_ids(tokenizer, messages, body, self.tools if native else None)

        try:
            if sum(len(message.get("content") or "") for message in messages) <= INLINE_TOKENIZE_CHARS:
                token_ids = encode()
            else:
                token_ids = await asyncio.to_thread(encode)
        except ValueError as error:  # no template, or the template rejected the conversation
            raise bad_request(f"Cannot apply the chat template: {error}", param="messages") from error
        token_ids = body.truncate(token_ids, info.max_model_len)
        max_tokens = check_context(len(token_ids), body.requested_max_tokens, info.max_model_len, "messages",
                                   info.kv_cache_tokens)
        tool_constraint = constraint_for(self.tools, self.tool_choice, body.parallel_tool_calls) if self.tools else None
        choices = []
        banned = await body.bad_words_token_ids_async(tokenizer)
        for sample in range(body.n):
            params = body.sampling_params(max_tokens, body.num_logprobs, sample, info.vocab_size,
                                          defaults=info.sampling_defaults, bad_words_token_ids=banned)
            if tool_constraint is not None:
                if params.structured_outputs is not None:
                    raise bad_request("tool_choice required or named cannot be combined with another output "
                                      "constraint", param="tool_choice")
                params = dataclasses.replace(params, structured_outputs=tool_constraint)
            choices.append(Choice(sample, 0, token_ids, params))
        return Prepared(choices, len(token_ids))

    def _message(self, output: RequestOutput) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice and its finish reason (tool calls parsed out)."""
        if self.tools is None:
            return {"role": "assistant", "content": self.echo + output.text}, output.finish_reason
        content, calls = parse_tool_calls(output.text, self.tool_choice, self.tool_call_parser)
        if not calls:
            return {"role": "assistant", "content": content}, output.finish_reason
        # As the stream's: `tool_calls` once a call is whole, else why it ended (a call cut short: `length`).
        reason = "tool_calls" if any(complete_call(call) for call in calls) else output.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, reason

    def opening(self, prepared: Prepared) -> list[dict[str, Any]]:
        return [{"index": choice.index, "delta": {"role": "assistant", "content": self.echo}, "logprobs": None,
                 "finish_reason": None} for choice in prepared.choices]

    def delta(self, choice: Choice, output: RequestOutput) -> dict[str, Any] | None:
        entries = output.new_logprobs if self.texts is not None else None
        delta: dict[str, Any] = {"content": output.new_text}
        if self.tools is not None:
            # Tool calls go out as the model writes them: the name once complete, then argument fragments.
            stream = self.tool_streams.setdefault(choice.index, ToolCallStream(self.tool_choice, self.tool_call_parser))
            content, calls = stream.feed(output.new_text)
            delta = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        extras: dict[str, Any] = {}
        if choice.index not in self.started:  # vLLM's prompt_logprobs ride on a choice's first chunk
            self.started.add(choice.index)
            extras = prompt_logprobs_field(self.token_texts, self.body.prompt_logprobs, output)
        if not delta.get("content") and "tool_calls" not in delta and not entries and not extras:
            return None
        logprobs = None
        if self.texts is not None and entries:
            logprobs = {"content": chat_logprobs(self.texts, entries), "refusal": None}
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": None} | extras

    def finish(self, output: RequestOutput) -> dict[str, Any]:
        if self.tools is None:
            return {"delta": {}, "logprobs": None, "finish_reason": output.finish_reason}
        stream = self.tool_streams.pop(choice_index(output.request_id), None)
        if stream is None:  # finished before any delta
            stream = ToolCallStream(self.tool_choice, self.tool_call_parser)
        content, calls = stream.close()
        delta = ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
        reason = "tool_calls" if stream.called else output.finish_reason
        return {"delta": delta, "logprobs": None, "finish_reason": reason}

    def whole(self, choice: Choice, output: RequestOutput) -> dict[str, Any]:
        logprobs = None
        if self.texts is not None:
            logprobs = {"content": chat_logprobs(self.texts, output.logprobs or []), "refusal": None}
        message, reason = self._message(output)
        return {"index": choice.index, "message": message,
                "logprobs": logprobs, "finish_reason": reason} | prompt_logprobs_field(
            self.token_texts, self.body.prompt_logprobs, output)


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    return [
        {"token": texts.text(entry.token_id), "logprob": entry.logprob, "bytes": texts.bytes(entry.token_id),
         "top_logprobs": [{"token": texts.text(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}
                          for token_id, logprob in entry.top]}
        for entry in entries
    ]
