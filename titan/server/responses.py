"""POST /v1/responses: OpenAI's Responses API, served by translating to and from chat completions.

The request runs the chat path unchanged (responses_protocol.py); its answer becomes a Response object, and
its SSE chunks become the Responses events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ..., `response.completed`), each
with its `sequence_number`, as OpenAI's SDKs read them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from titan.server.chat import create_chat_completion
from titan.server.errors import APIError
from titan.server.responses_protocol import ResponsesRequest, responses_param
from titan.server.serving import ServerState


async def create_response(state: ServerState, body: ResponsesRequest, request: Request) -> Response:
    body.check()
    try:
        answer = await create_chat_completion(state, body.to_chat(), request)
    except APIError as error:  # name the fields as this API does
        error.param = responses_param(error.param)
        raise
    if answer.status_code != HTTPStatus.OK:
        return answer  # the client left (499): nothing to translate
    headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
    shell = ResponseShell(body, body.model or state.model_name)
    if not isinstance(answer, StreamingResponse):
        return JSONResponse(shell.whole(json.loads(bytes(answer.body))), status_code=answer.status_code,
                            headers=headers)
    return StreamingResponse(shell.events(answer.body_iterator), media_type="text/event-stream", headers=headers,
                             background=answer.background)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat is None:
        return None
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)] if status == "completed" or text else []}


def _chat_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's token log probabilities: the same objects (token, logprob, bytes, top_logprobs)."""
    return (choice.get("logprobs") or {}).get("content") or []


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


class ResponseShell:
    """The Response object around the chat answer: its id, the request's settings, status and usage."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.model = model
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.sequence = 0

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  finish_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        # A chat answer cut at max_tokens, or by an output guardrail, is an incomplete response.
        incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(finish_reason or "")
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "error": None,
                "model": self.model, "instructions": body.instructions, "output": output,
                "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
                "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
                "parallel_tool_calls": body.parallel_tool_calls, "text": text, "metadata": body.metadata or {},
                "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
                "top_logprobs": body.top_logprobs, "user": body.user, "usage": _usage(usage)}

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("content"):
            output.append(_message_item(_id("msg"), message["content"], "completed", _chat_logprobs(choice)))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(_id("fc"), call, "completed"))
        return self.response("completed", output, chat.get("usage"), choice.get("finish_reason"))

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    async def events(self, chunks: AsyncIterator[bytes | str | memoryview]) -> AsyncIterator[bytes]:
        """The chat stream's chunks as Responses events."""
        stream = _ChatStream(self)
        yield self.event("response.created", response=self.response("in_progress", [], None))
        yield self.event("response.in_progress", response=self.response("in_progress", [], None))
        buffer = b""
        try:
            async for piece in chunks:
                buffer += piece.encode() if isinstance(piece, str) else bytes(piece)
                while b"\n\n" in buffer:
                    line, buffer = buffer.split(b"\n\n", 1)
                    data = line.decode().removeprefix("data: ")
                    if data == "[DONE]":
                        continue
                    for event in stream.feed(json.loads(data)):
                        yield event
        finally:  # a client gone: the chat stream's own cleanup aborts the engine requests now
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        for event in stream.close():
            yield event


class _ChatStream:
    """The state of one streamed chat answer as Responses output items: a message, then function calls."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.output: list[dict[str, Any]] = []  # items done
        self.text: str | None = None  # the open message's text (None: no message open)
        self.logprobs: list[dict[str, Any]] = []  # the open message's tokens'
        self.pending: list[dict[str, Any]] = []  # tokens whose text has not come out yet (held back)
        self.message_id = _id("msg")
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index → open function_call item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.failed: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        event = self.shell.event
        if "error" in chunk:  # the engine failed after the 200 went out
            self.failed = chunk["error"]
            return []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.pending += _chat_logprobs(choice)
            if delta.get("content"):
                if self.text is None:
                    self.text = ""
                    out.append(event("response.output_item.added", output_index=len(self.output),
                                     item=_message_item(self.message_id, "", "in_progress", [])))
                    out.append(event("response.content_part.added", item_id=self.message_id,
                                     output_index=len(self.output), content_index=0, part=_text_part("", [])))
                self.text += delta["content"]
                logprobs, self.pending = self.pending, []
                self.logprobs += logprobs
                out.append(event("response.output_text.delta", item_id=self.message_id,
                                 output_index=len(self.output), content_index=0, delta=delta["content"],
                                 logprobs=logprobs))
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        event = self.shell.event
        out = self._close_message()
        self.pending = []  # a call's tokens: a function_call item has no log probabilities
        item = self.calls.get(call["index"])
        function = call.get("function") or {}
        if item is None:
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
                    "name": function.get("name") or "", "arguments": "", "status": "in_progress"}
            self.calls[call["index"]] = item
            item["output_index"] = len(self.output) + len(self.calls) - 1
            out.append(event("response.output_item.added", output_index=item["output_index"],
                             item={k: v for k, v in item.items() if k != "output_index"}))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(event("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=item["output_index"], delta=function["arguments"]))
        return out

    def _close_message(self) -> list[bytes]:
        if self.text is None:
            return []
        event, index, text = self.shell.event, len(self.output), self.text
        logprobs, self.logprobs, self.pending = self.logprobs + self.pending, [], []
        part = _text_part(text, logprobs)
        item = _message_item(self.message_id, text, "completed", logprobs)
        self.output.append(item)
        self.text = None
        return [event("response.output_text.done", item_id=self.message_id, output_index=index, content_index=0,
                      text=text, logprobs=logprobs),
                event("response.content_part.done", item_id=self.message_id, output_index=index, content_index=0,
                      part=part),
                event("response.output_item.done", output_index=index, item=item)]

    def close(self) -> list[bytes]:
        event = self.shell.event
        if self.failed is not None:
            failed = self.shell.response("failed", self.output, self.usage) | {"error": {
                "code": "server_error", "message": self.failed.get("message", "")}}
            return [event("response.failed", response=failed)]
        out = self._close_message()
        for item in self.calls.values():
            index = item.pop("output_index")
            item["status"] = "completed"
            out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"]))
            out.append(event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        response = self.shell.response("completed", self.output, self.usage, self.finish_reason)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [event(kind, response=response)]
