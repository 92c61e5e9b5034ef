"""The offline API: `LLM("default").generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence as SequenceType
from typing import Any

from titan.config import EngineConfig
from titan.config_flags import engine_config
from titan.engine.llm_engine import LLMEngine
from titan.engine.outputs import RequestOutput
from titan.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "default", **engine_args: Any) -> None:
        """`engine_args` are the engine flags' names (titan.config_flags), e.g. `max_num_seqs=8`."""
        self._attach(LLMEngine(engine_config(model, **engine_args)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(config))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceType[Prompt],
        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        order: dict[str, int] = {}
        try:
            for index, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
                seq = self.engine.add_request(prompt, params)
                order[seq.request_id] = index
        except Exception:
            for request_id in order:  # all or nothing: a rejected prompt leaves no orphans behind
                self.engine.abort(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(order)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished and output.request_id in order:
                    results[order[output.request_id]] = output
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> RequestOutput:
        """One reply to `messages`, rendered by the model's chat template (vLLM's `LLM.chat` keywords:
        `continue_final_message` goes on with the last message, and needs `add_generation_prompt=False`)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                  continue_final_message=continue_final_message,
                                                  **(chat_template_kwargs or {}))
        return self.generate(self.tokenizer.encode(text), sampling_params)[0]
