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
from titan.server.serving import Choice, ServerState, TokenTexts, prompt_logprobs_field, tokenize


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
        self.started: set[int] = set()  # choices whose first delta went out

    def num_sequences(self) -> int:
        return len(self.body.prompts()) * self.body.n

    def wants_logprobs(self) -> bool:
        return self.body.logprobs is not None

    async def prepare(self, info: EngineInfo) -> Prepared:
        body = self.body
        prompt_ids: list[list[int]] = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompt_ids.append(await tokenize(info.tokenizer, prompt, body.add_special_tokens))
            else:
                check_token_ids(prompt, info.vocab_size)
                prompt_ids.append(list(prompt))
        whole = [len(ids) for ids in prompt_ids]
        prompt_ids = [body.truncate(ids, info.max_model_len) for ids in prompt_ids]
        if body.echo:
            # A text prompt echoes as sent (vLLM's rule); token ids, or a text cut by truncate_prompt_tokens,
            # decode with their special tokens ("<|im_start|>user" came back as "user").
            self.echoes = [prompt if isinstance(prompt, str) and len(ids) == length
                           else info.tokenizer.decode(ids, skip_special_tokens=False)
                           for prompt, ids, length in zip(body.prompts(), prompt_ids, whole, strict=True)]
        else:
            self.echoes = [""] * len(prompt_ids)
        choices = []
        # echo + logprobs scores the prompt too (log-likelihood evaluation); max_tokens 0 then runs one token
        # that is never shown.
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        requested = 1 if body.scores_prompt_only else body.max_tokens
        banned = await body.bad_words_token_ids_async(info.tokenizer)
        for prompt_index, token_ids in enumerate(prompt_ids):
            max_tokens = check_context(len(token_ids), requested, info.max_model_len,
                                       kv_cache_tokens=info.kv_cache_tokens)
            for sample in range(body.n):
                params = body.sampling_params(max_tokens, body.logprobs, sample, info.vocab_size, prompt_logprobs,
                                              info.sampling_defaults, banned)
                choices.append(Choice(prompt_index * body.n + sample, prompt_index, token_ids, params))
        return Prepared(choices, sum(len(ids) for ids in prompt_ids))

    def opening(self, prepared: Prepared) -> list[dict[str, Any]]:
        entries = []
        for choice in prepared.choices:
            echo = self.echoes[choice.prompt_index]
            self.text_offsets[choice.index] = len(echo)
            if self.body.echo and not self.wants_logprobs():
                entries.append({"index": choice.index, "text": echo, "logprobs": None, "finish_reason": None})
        return entries

    def delta(self, choice: Choice, output: RequestOutput) -> dict[str, Any] | None:
        first = choice.index not in self.started
        self.started.add(choice.index)
        entries = output.new_logprobs if self.texts is not None else None
        new_text = output.new_text
        if self.body.scores_prompt_only:  # the one token run to score the prompt is never shown
            entries, new_text = [], ""
        offset = self.text_offsets[choice.index]
        logprobs = legacy_logprobs(self.texts, entries, offset) if self.texts is not None and entries else None
        # Offsets follow the tokens' texts, as the whole response's do: the released text lags them while a
        # possible stop string is held back, and a character split over tokens is released once.
        if logprobs is not None:
            self.text_offsets[choice.index] = offset + sum(len(token) for token in logprobs["tokens"])
        extras: dict[str, Any] = {}
        if first:
            # The prompt's logprobs come with the first token: echo + logprobs sends the prompt's text here,
            # with them, rather than before any token; vLLM's prompt_logprobs field rides on this chunk.
            if self.body.echo and self.texts is not None:
                logprobs = with_prompt(self.texts, logprobs or legacy_logprobs(self.texts, [], offset),
                                       choice.prompt_token_ids, output.prompt_logprobs or [])
                new_text = self.echoes[choice.prompt_index] + new_text
            extras = prompt_logprobs_field(self.token_texts, self.body.prompt_logprobs, output)
        if not new_text and not logprobs and not extras:
            if first:
                self.started.discard(choice.index)  # nothing to say yet: the next output is still the first
            return None
        return {"index": choice.index, "text": new_text, "logprobs": logprobs, "finish_reason": None} | extras

    def finish(self, output: RequestOutput) -> dict[str, Any]:
        return {"text": "", "logprobs": None, "finish_reason": output.finish_reason}

    def completion_tokens(self, output: RequestOutput) -> int:
        return 0 if self.body.scores_prompt_only else output.num_output_tokens

    def shows_tokens(self) -> bool:
        return not self.body.scores_prompt_only

    def whole(self, choice: Choice, output: RequestOutput) -> dict[str, Any]:
        echo = self.echoes[choice.prompt_index]
        only_prompt = self.body.scores_prompt_only
        logprobs = None
        if self.texts is not None:
            logprobs = legacy_logprobs(self.texts, [] if only_prompt else output.logprobs or [], len(echo))
            if self.body.echo:
                logprobs = with_prompt(self.texts, logprobs, choice.prompt_token_ids, output.prompt_logprobs or [])
        entry = {"index": choice.index, "text": echo + ("" if only_prompt else output.text), "logprobs": logprobs,
                 "finish_reason": "length" if only_prompt else output.finish_reason}
        return entry | prompt_logprobs_field(self.token_texts, self.body.prompt_logprobs, output)


def with_prompt(texts: TokenTexts, completion: dict[str, Any], prompt_ids: list[int],
                prompt: list[TokenLogprobs | None]) -> dict[str, Any]:
    """The legacy logprobs object with the prompt's tokens first (echo): the first token has no logprob."""
    tokens = [texts.text(token_id) for token_id in prompt_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    token_logprobs = [entry.logprob if entry is not None else None for entry in prompt]
    top = [None if entry is None else {texts.text(t): lp for t, lp in [(entry.token_id, entry.logprob), *entry.top]}
           for entry in prompt]
    return {"tokens": tokens + completion["tokens"], "token_logprobs": token_logprobs + completion["token_logprobs"],
            "top_logprobs": top + completion["top_logprobs"], "text_offset": offsets + completion["text_offset"]}


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
