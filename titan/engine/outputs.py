"""What the engine hands back per request and step; the output processor turns tokens into text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from titan.engine.scheduler import Scheduler
from titan.engine.scheduler_output import RunnerOutput, TokenLogprobs
from titan.engine.sequence import Sequence, SequenceStatus
from titan.engine.timeline import summarize
from titan.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # every output character so far (stop strings excluded)
    new_token_ids: list[int]  # tokens produced by this step
    new_text: str  # text released by this step (a streaming delta)
    finished: bool
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # time.monotonic() stamps: arrival, first_scheduled, first_token, finished (absent until they happen)
    metrics: dict[str, float] = field(default_factory=dict)
    # Set on the final output: queued, prefill chunks, decode, preemptions, longest stall (timeline.summarize).
    timeline: dict[str, Any] | None = None
    # Degradations applied under pressure, e.g. {"max_tokens": {"requested": 512, "applied": 64}}.
    degradations: dict[str, dict[str, int]] = field(default_factory=dict)


class OutputProcessor:
    """Incremental detokenization and stop strings; ends sequences whose text hit a stop string."""

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.logprobs: dict[int, list[TokenLogprobs]] = {}

    def add(self, seq: Sequence) -> None:
        params = seq.sampling_params
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
        )
        if params.logprobs is not None:
            self.logprobs[seq.seq_id] = []

    def process(self, advanced: list[Sequence], runner_output: RunnerOutput) -> list[RequestOutput]:
        logprobs_by_seq = dict(zip(runner_output.seq_ids, runner_output.logprobs, strict=True))
        outputs = []
        for seq in advanced:
            detokenizer = self.detokenizers[seq.seq_id]
            token_id = seq.output_token_ids[-1]
            new_text = detokenizer.append(token_id)
            entry = logprobs_by_seq.get(seq.seq_id)
            if entry is not None and seq.seq_id in self.logprobs:
                self.logprobs[seq.seq_id].append(entry)
            if detokenizer.stop_string is not None and not seq.is_finished:
                seq.stop_reason = detokenizer.stop_string
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            outputs.append(self._output(seq, [token_id], new_text))
        return outputs

    def aborted(self, seq: Sequence) -> RequestOutput:
        return self._output(seq, [], "")

    def _output(self, seq: Sequence, new_token_ids: list[int], new_text: str) -> RequestOutput:
        detokenizer = self.detokenizers[seq.seq_id]
        finished = seq.is_finished
        if finished:
            if detokenizer.stop_string is None:
                new_text += detokenizer.flush()
            self.detokenizers.pop(seq.seq_id)
        logprobs = self.logprobs.pop(seq.seq_id, None) if finished else self.logprobs.get(seq.seq_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=detokenizer.text,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.status.value if finished else None,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            metrics=_timeline(seq),
            timeline=summarize(seq) if finished else None,
            degradations=seq.degradations,
        )


def _timeline(seq: Sequence) -> dict[str, float]:
    stamps = {
        "arrival": seq.arrival_time,
        "first_scheduled": seq.first_scheduled_time,
        "first_token": seq.first_token_time,
        "finished": seq.finished_time,
    }
    return {name: value for name, value in stamps.items() if value is not None}
