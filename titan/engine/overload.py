"""The step duration the slo policy holds an overload at: the step the batch settles into once it is full.

Under an overload (prompt tokens arriving faster than even whole-budget steps prefill them) fcfs and the drain
both took the whole budget, and the token gaps split in two: while the batch grew, steps of a few dozen
decodes and ~500 prompt tokens (~860 ms served); once it held `max_num_seqs` sequences, decode-only steps
(~185 ms) whenever no slot had freed, and a whole prompt's step (~450 ms) when one had. ITL P99 was 3.9x the
P50 on steady@1.5 (benchmarks/default_policy.py, an AMX Xeon).

The full batch's own step is the one duration an overload can keep: `max_num_seqs` decodes and the prompt
tokens that refill the slots they free, each request's prompt per its output, times OVERLOAD_REFILL_SHARE.
Held at it, the batch still grows to full width (the step does not follow the narrow batch's width, the
trap of bounding a drain by the typical decodes' step), and once full, steps keep carrying a share of a
prompt rather than a whole one or none: refilling a little slower than the slots free keeps a few prompts
mid-prefill, so every step has some to compute. Output per second moves a little: a request's rows are the
same however they are spread over steps, but more steps pay the per-step cost, and the batch is a few slots
narrower while prompts are mid-prefill (served steady@1.5: 0.93-0.97x fcfs's output tok/s).
"""

from __future__ import annotations

from titan.engine.cost_model import StepCostModel, StepShape

# Refill the full batch's freed slots at this share of the rate they free at: under 1 so that prompts queue
# mid-prefill and every step carries some, rather than a whole prompt in one step and none in the next.
OVERLOAD_REFILL_SHARE = 0.8
# Requests whose output lengths the mean is over (exponentially weighted by finishes). Over 32, served, the
# mean still carried a calibration's 4-32-token outputs 15 s into steady@1.5 (64 tokens each), and the bound
# sat at ~550 ms where the full batch's step is ~340: the growing batch's steps there were the ITL P99 (2.1x).
OUTPUT_LENGTH_SPAN = 8


class OutputLengths:
    """The mean output length of recently finished requests (exponentially weighted, over about
    OUTPUT_LENGTH_SPAN of them); None until one has finished."""

    def __init__(self, span: int = OUTPUT_LENGTH_SPAN) -> None:
        self.weight = 2.0 / (span + 1)
        self.mean: float | None = None

    def record(self, num_output_tokens: int) -> None:
        if num_output_tokens <= 0:
            return
        if self.mean is None:
            self.mean = float(num_output_tokens)
        else:
            self.mean += self.weight * (num_output_tokens - self.mean)


def full_batch_step(cost_model: StepCostModel, typical: StepShape, max_num_seqs: int, token_budget: int,
                    prompt_tokens: float, output_tokens: float, prompt_start: int = 0,
                    kv_cache_tokens: int | None = None) -> float:
    """The predicted duration of a step of the full batch: `max_num_seqs` decodes (or as many as a KV cache of
    `kv_cache_tokens` holds, each request's prompt and output in it), each attending to as much as a `typical`
    decode does, beside the prompt tokens that refill their slots at OVERLOAD_REFILL_SHARE of the rate they
    free (`prompt_tokens` computed, from `prompt_start`, per request of `output_tokens` output), within
    `token_budget` tokens in all. 0 when nothing is known yet (no typical decodes or lengths)."""
    if typical.num_sequences <= 0 or prompt_tokens <= 0 or output_tokens <= 0:
        return 0.0
    width = min(max_num_seqs, token_budget)
    if kv_cache_tokens is not None:
        # A prefix-cache hit is shared and left out of `prompt_tokens`: what each request adds is its own part.
        width = max(1, min(width, int(kv_cache_tokens // (prompt_tokens + output_tokens))))
    per_decode = typical.attention_pairs / typical.num_sequences
    decodes = StepShape(width, width, width * per_decode)
    refill = OVERLOAD_REFILL_SHARE * width * prompt_tokens / output_tokens
    chunk = max(0, min(round(refill), token_budget - width))
    return cost_model.predict(decodes.plus(chunk, prompt_start) if chunk else decodes)
