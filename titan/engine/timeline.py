"""One request's story, step by step: queued, prefill chunks, decode, preemptions, and its longest stall.

The engine records it as steps complete (`LLMEngine.step`); it is summarized once, when the request
finishes, for the `titan_timeline` response field and the slow-request log. The longest stall is the
longest gap between two consecutive output tokens, and its cause is read from the engine steps that ran
during that gap (the same ring buffer `/debug/steps` serves).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from titan.engine.sequence import Sequence

# A gap is blamed on the garbage collector when its pauses took at least this share of it.
GC_SHARE = 0.25
STALL_CAUSES = ("preemption", "gc", "queueing", "prefill_interference", "decode")


class StepLike(Protocol):
    """What the timeline reads from an engine step record."""

    started: float
    duration: float
    num_prefill_tokens: int
    gc_pause: float


@dataclass(frozen=True)
class PrefillChunk:
    started: float  # time.monotonic() when its step began
    num_tokens: int
    duration: float  # of the whole step it ran in
    recompute: bool  # recomputing K/V dropped by a preemption


@dataclass(frozen=True)
class Stall:
    seconds: float
    ended: float  # time.monotonic() of the token that ended it
    cause: str  # one of STALL_CAUSES


@dataclass
class RequestTimeline:
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    num_decode_steps: int = 0
    last_token_time: float | None = None
    preemptions_at_last_token: int = 0
    longest_stall: Stall | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and how many were accepted
    num_accepted_tokens: int = 0

    def record_chunk(self, started: float, num_tokens: int, duration: float, recompute: bool) -> None:
        self.prefill_chunks.append(PrefillChunk(started, num_tokens, duration, recompute))

    def record_token(self, now: float, num_preemptions: int, recent_steps: Iterable[StepLike]) -> None:
        """A new output token at `now`; `recent_steps` yields engine steps newest first."""
        last = self.last_token_time
        if last is not None:
            self.num_decode_steps += 1
            gap = now - last
            if self.longest_stall is None or gap > self.longest_stall.seconds:
                preempted = num_preemptions > self.preemptions_at_last_token
                self.longest_stall = Stall(gap, now, stall_cause(gap, preempted, last, recent_steps))
        self.last_token_time = now
        self.preemptions_at_last_token = num_preemptions


def stall_cause(gap: float, preempted: bool, since: float, recent_steps: Iterable[StepLike]) -> str:
    """Why no token came for `gap` seconds after `since`, judged from the steps that ended in between."""
    if preempted:
        return "preemption"
    steps = []
    for step in recent_steps:
        if step.started + step.duration <= since:
            break
        steps.append(step)
    if sum(step.gc_pause for step in steps) >= GC_SHARE * gap:
        return "gc"
    if len(steps) > 1:
        return "queueing"  # steps ran without this request: it waited for budget or for higher priorities
    if any(step.num_prefill_tokens > 0 for step in steps):
        return "prefill_interference"
    return "decode"


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def summarize(seq: Sequence) -> dict[str, Any]:
    """The finished request's timeline in milliseconds since it arrived (JSON-ready)."""
    timeline = seq.timeline
    arrival = seq.arrival_time

    def since_arrival(stamp: float | None) -> float | None:
        return None if stamp is None else _ms(stamp - arrival)

    stall = timeline.longest_stall
    return {
        "queued_ms": since_arrival(seq.first_scheduled_time),
        "ttft_ms": since_arrival(seq.first_token_time),
        "e2e_ms": since_arrival(seq.finished_time),
        "prompt_tokens": seq.num_prompt_tokens,
        "cached_prompt_tokens": seq.num_cached_tokens,
        "prefill_chunks": [
            {"start_ms": _ms(chunk.started - arrival), "tokens": chunk.num_tokens,
             "step_ms": _ms(chunk.duration), "recompute": chunk.recompute}
            for chunk in timeline.prefill_chunks
        ],
        "decode_steps": timeline.num_decode_steps,
        "output_tokens": seq.num_output_tokens,
        "draft_tokens": timeline.num_draft_tokens,
        "accepted_draft_tokens": timeline.num_accepted_tokens,
        "preemptions": seq.num_preemptions,
        "recomputed_tokens": seq.num_recomputed_tokens,
        "preempted_ms": _ms(seq.preempted_seconds),
        "longest_stall": None if stall is None else {
            "ms": _ms(stall.seconds), "end_ms": _ms(stall.ended - arrival), "cause": stall.cause},
    }
