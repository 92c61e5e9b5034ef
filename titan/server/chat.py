"""POST /v1/chat/completions: the model's chat template, n choices, whole or streamed as SSE."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from titan.engine.llm_engine import EngineInfo
from titan.engine.outputs import RequestOutput
from titan.engine.scheduler_output import TokenLogprobs
from titan.server.errors import bad_request
from titan.server.generation import GenerationRoute, Prepared, handle_generation
from titan.server.protocol import ChatCompletionRequest, check_context
from titan.server.serving import INLINE_TOKENIZE_CHARS, Choice, ServerState, TokenTexts, prompt_logprobs_field


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    return await handle_generation(state, ChatRoute(body), request)


class ChatRoute(GenerationRoute):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    body: ChatCompletionRequest

    def num_sequences(self) -> int:
        return self.body.n

    def wants_logprobs(self) -> bool:
        return self.body.logprobs

    async def prepare(self, info: EngineInfo) -> Prepared:
        body = self.body
        self.tokenizer = info.tokenizer
        messages = body.template_messages()
        tokenizer = info.tokenizer
        try:
            if sum(len(message["content"]) for message in messages) <= INLINE_TOKENIZE_CHARS:
                token_ids = tokenizer.encode_chat(messages)
            else:
                token_ids = await asyncio.to_thread(tokenizer.encode_chat, messages)
        except ValueError as error:  # no template, or the template rejected the conversation
            raise bad_request(f"Cannot apply the chat template: {error}", param="messages") from error
        max_tokens = check_context(len(token_ids), body.requested_max_tokens, info.max_model_len, "messages")
        choices = [Choice(sample, 0, token_ids,
                          body.sampling_params(max_tokens, body.num_logprobs, sample, info.vocab_size))
                   for sample in range(body.n)]
        return Prepared(choices, len(token_ids))

    def opening(self, prepared: Prepared) -> list[dict[str, Any]]:
        return [{"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for choice in prepared.choices]

    def delta(self, choice: Choice, output: RequestOutput) -> dict[str, Any] | None:
        entries = output.new_logprobs if self.texts is not None else None
        if not output.new_text and not entries:
            return None
        logprobs = None
        if self.texts is not None and entries:
            logprobs = {"content": chat_logprobs(self.texts, entries), "refusal": None}
        return {"index": choice.index, "delta": {"content": output.new_text}, "logprobs": logprobs,
                "finish_reason": None}

    def finish(self, output: RequestOutput) -> dict[str, Any]:
        return {"delta": {}, "logprobs": None, "finish_reason": output.finish_reason}

    def whole(self, choice: Choice, output: RequestOutput) -> dict[str, Any]:
        logprobs = None
        if self.texts is not None:
            logprobs = {"content": chat_logprobs(self.texts, output.logprobs or []), "refusal": None}
        return {"index": choice.index, "message": {"role": "assistant", "content": output.text},
                "logprobs": logprobs, "finish_reason": output.finish_reason} | prompt_logprobs_field(
            self.texts or TokenTexts(self.tokenizer), self.body.prompt_logprobs, output)


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    return [
        {"token": texts.text(entry.token_id), "logprob": entry.logprob, "bytes": texts.bytes(entry.token_id),
         "top_logprobs": [{"token": texts.text(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}
                          for token_id, logprob in entry.top]}
        for entry in entries
    ]
