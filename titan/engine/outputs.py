"""What the engine hands back per request and step: deltas while it runs, plus a summary when it ends.

The output stage detokenizes the tokens a step committed and finds stop strings; it returns those
stop decisions to the engine (which finishes the sequences through the scheduler) and never changes
engine state itself. Each output carries only what the step added (tokens, text, logprobs), so a long
generation costs O(1) per token; the final output also carries the whole result once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from titan.engine.scheduler_output import TokenLogprobs
from titan.engine.sequence import Advanced, Sequence
from titan.engine.timeline import summarize
from titan.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced by this step
    new_text: str  # text released by this step (a streaming delta; stop strings excluded)
    finished: bool
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far, this step's included
    new_logprobs: list[TokenLogprobs] | None = None  # this step's entries, when logprobs were asked for
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # time.monotonic() stamps: arrival, first_scheduled, first_token, finished (absent until they happen)
    metrics: dict[str, float] = field(default_factory=dict)
    # The summary, on the final output only: the prompt, every output token, the whole text, every logprob entry.
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # by prompt position; the first has none
    # Set on the final output: queued, prefill chunks, decode, preemptions, longest stall (timeline.summarize).
    timeline: dict[str, Any] | None = None
    # Degradations applied under pressure, e.g. {"max_tokens": {"requested": 512, "applied": 64}}.
    degradations: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class _Delta:
    seq: Sequence
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None


@dataclass
class Detokenized:
    """One step's text deltas, and the sequences whose text reached a stop string (the engine ends them)."""

    deltas: list[_Delta] = field(default_factory=list)
    # (sequence, stop string, output tokens to keep: those up to the one that completed the string)
    stopped: list[tuple[Sequence, str, int]] = field(default_factory=list)


class OutputProcessor:
    """Incremental detokenization, stop strings and logprob collection per request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.logprobs: dict[int, list[TokenLogprobs]] = {}

    def add(self, seq: Sequence) -> None:
        params = seq.sampling_params
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop=params.include_stop_str_in_output,
        )
        if params.logprobs is not None:
            self.logprobs[seq.seq_id] = []

    def detokenize(self, advanced: list[Advanced]) -> Detokenized:
        """The text each advanced sequence's new tokens complete; stop strings become decisions. A stop
        string completed by one of several tokens of a step (accepted drafts) drops the tokens after it."""
        result = Detokenized()
        for item in advanced:
            seq = item.seq
            detokenizer = self.detokenizers[seq.seq_id]
            text = ""
            kept = 0
            for token_id in item.token_ids:
                text += detokenizer.append(token_id)
                kept += 1
                if detokenizer.stop_string is not None:
                    break
            token_ids = item.token_ids[:kept]
            entries = None
            if seq.seq_id in self.logprobs:
                entries = [entry for entry in item.logprobs[:kept] if entry is not None]
                self.logprobs[seq.seq_id].extend(entries)
            # A sequence that a later token of this step finished (a stop token, its length) still stops at
            # the string, as it would have without speculation.
            if detokenizer.stop_string is not None and (not seq.is_finished or kept < len(item.token_ids)):
                num_output_tokens = seq.num_output_tokens - (len(item.token_ids) - kept)
                result.stopped.append((seq, detokenizer.stop_string, num_output_tokens))
            result.deltas.append(_Delta(seq, token_ids, text, entries))
        return result

    def emit(self, detokenized: Detokenized) -> list[RequestOutput]:
        """Outputs for the step's deltas; call after the engine applied the stop decisions."""
        return [self._output(d.seq, d.token_ids, d.text, d.logprobs) for d in detokenized.deltas]

    def aborted(self, seq: Sequence) -> RequestOutput:
        return self._output(seq, [], "", [] if seq.seq_id in self.logprobs else None)

    def _output(self, seq: Sequence, new_token_ids: list[int], new_text: str,
                new_logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        output = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=seq.is_finished,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            new_logprobs=new_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            metrics=_stamps(seq),
            degradations=seq.degradations,
        )
        if new_token_ids and seq.num_output_tokens == len(new_token_ids):
            output.prompt_logprobs = seq.prompt_logprobs  # with the first token: a stream can send them at once
        if output.finished:
            detokenizer = self.detokenizers.pop(seq.seq_id)
            if detokenizer.stop_string is None:
                output.new_text += detokenizer.flush()
            output.finish_reason = seq.status.value
            output.stop_reason = seq.stop_reason
            output.prompt_token_ids = seq.prompt_token_ids
            output.token_ids = list(seq.output_token_ids)
            output.text = detokenizer.text
            output.logprobs = self.logprobs.pop(seq.seq_id, None)
            output.prompt_logprobs = seq.prompt_logprobs
            output.timeline = summarize(seq)
        return output


def _stamps(seq: Sequence) -> dict[str, float]:
    stamps = {
        "arrival": seq.arrival_time,
        "first_scheduled": seq.first_scheduled_time,
        "first_token": seq.first_token_time,
        "finished": seq.finished_time,
    }
    return {name: value for name, value in stamps.items() if value is not None}
