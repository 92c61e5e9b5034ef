"""POST /v1/completions: prompts (text or token ids) × n choices, whole or streamed as SSE."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from titan.engine.llm_engine import EngineInfo
from titan.engine.outputs import RequestOutput
from titan.engine.scheduler_output import TokenLogprobs
from titan.server.generation import GenerationRoute, Prepared, handle_generation
from titan.server.protocol import CompletionRequest, check_context, check_token_ids
from titan.server.serving import Choice, ServerState, TokenTexts, tokenize


async def create_completion(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    return await handle_generation(state, CompletionRoute(body), request)


class CompletionRoute(GenerationRoute):
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"
    body: CompletionRequest

    def __init__(self, body: CompletionRequest) -> None:
        super().__init__(body)
        self.echoes: list[str] = []
        self.text_offsets: dict[int, int] = {}  # choice index → characters streamed so far (logprobs)

    def num_sequences(self) -> int:
        return len(self.body.prompts()) * self.body.n

    def wants_logprobs(self) -> bool:
        return self.body.logprobs is not None

    async def prepare(self, info: EngineInfo) -> Prepared:
        body = self.body
        prompt_ids: list[list[int]] = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompt_ids.append(await tokenize(info.tokenizer, prompt))
            else:
                check_token_ids(prompt, info.vocab_size)
                prompt_ids.append(list(prompt))
        choices = []
        for prompt_index, token_ids in enumerate(prompt_ids):
            max_tokens = check_context(len(token_ids), body.max_tokens, info.max_model_len)
            for sample in range(body.n):
                params = body.sampling_params(max_tokens, body.logprobs, sample, info.vocab_size)
                choices.append(Choice(prompt_index * body.n + sample, prompt_index, token_ids, params))
        self.echoes = [info.tokenizer.decode(ids) if body.echo else "" for ids in prompt_ids]
        return Prepared(choices, sum(len(ids) for ids in prompt_ids))

    def opening(self, prepared: Prepared) -> list[dict[str, Any]]:
        entries = []
        for choice in prepared.choices:
            echo = self.echoes[choice.prompt_index]
            self.text_offsets[choice.index] = len(echo)
            if self.body.echo:
                entries.append({"index": choice.index, "text": echo, "logprobs": None, "finish_reason": None})
        return entries

    def delta(self, choice: Choice, output: RequestOutput) -> dict[str, Any] | None:
        entries = output.new_logprobs if self.texts is not None else None
        if not output.new_text and not entries:
            return None
        offset = self.text_offsets[choice.index]
        self.text_offsets[choice.index] = offset + len(output.new_text)
        logprobs = legacy_logprobs(self.texts, entries, offset) if self.texts is not None and entries else None
        return {"index": choice.index, "text": output.new_text, "logprobs": logprobs, "finish_reason": None}

    def finish(self, output: RequestOutput) -> dict[str, Any]:
        return {"text": "", "logprobs": None, "finish_reason": output.finish_reason}

    def whole(self, choice: Choice, output: RequestOutput) -> dict[str, Any]:
        echo = self.echoes[choice.prompt_index]
        logprobs = None
        if self.texts is not None:
            logprobs = legacy_logprobs(self.texts, output.logprobs or [], len(echo))
        return {"index": choice.index, "text": echo + output.text, "logprobs": logprobs,
                "finish_reason": output.finish_reason}


def legacy_logprobs(texts: TokenTexts, entries: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object for `entries`, the first token at `text_offset`."""
    text = texts.text
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
