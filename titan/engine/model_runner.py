"""Turns one SchedulerOutput into model inputs, runs the model, and samples: it computes, never decides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan.config import ModelConfig
from titan.engine.sampler import compute_logprobs
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import PromptLogprobs, RunnerOutput, ScheduledSequence, SchedulerOutput
from titan.engine.spec.verify import accept, generator_states, sampling_rows
from titan.model.attention import AttentionMetadata, build_attention_metadata
from titan.model.llama import LlamaForCausalLM
from titan.model.native_attention import native_attention_module

if TYPE_CHECKING:
    from titan.engine.sampler import Sampler


@dataclass
class _StepInputs:
    input_ids: torch.Tensor  # [T], decodes first then prefill chunks
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    row_ranges: list[tuple[int, int]]  # per scheduled sequence (scheduled order): its rows in the batch


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sampler: Sampler,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.sampler = sampler
        self.model = LlamaForCausalLM(model_config, device=self.device, dtype=dtype)
        self.model.load_weights(weights)
        self.model.eval()
        # Uninitialized (no memory is touched until blocks are used) plus one trailing null slot that
        # stays zero: padded decode columns read it instead of whatever garbage sits in the pool.
        self.null_slot = num_blocks * block_size
        cache_shape = (self.null_slot + 1, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = []
        for _ in range(model_config.num_hidden_layers):
            key_cache = torch.empty(cache_shape, device=self.device, dtype=self.kv_cache_dtype)
            value_cache = torch.empty(cache_shape, device=self.device, dtype=self.kv_cache_dtype)
            key_cache[self.null_slot].zero_()
            value_cache[self.null_slot].zero_()
            self.kv_caches.append((key_cache, value_cache))
        self.model.bind_kv_cache(self.kv_caches)
        # Decode rows and short chunks through the native paged attention kernel (CPU float32, its cache
        # float32 or float16).
        self.native_attention = native_attention_module(self.device, dtype, self.kv_cache_dtype) is not None

    @staticmethod
    def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one block across all layers."""
        per_token = 2 * model_config.num_key_value_heads * model_config.head_dim * dtype.itemsize
        return per_token * block_size * model_config.num_hidden_layers

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step; one sampled token per `sample` sequence, in `scheduled` order, plus the prompt
        logprobs of sequences that asked for them."""
        if scheduler_output.is_empty:
            return RunnerOutput()
        with torch.inference_mode():
            inputs, hidden = self._forward(scheduler_output.scheduled)
            logits, requests = self._logits_for_sampling(scheduler_output.scheduled, inputs, hidden)
            prompt_logprobs = self._prompt_logprobs(scheduler_output.scheduled, inputs, hidden)
            if not requests:
                return RunnerOutput(prompt_logprobs=prompt_logprobs)
            states = generator_states(scheduler_output.scheduled)
            token_ids, logprobs = self.sampler(logits, requests)
        output = accept(scheduler_output.scheduled, token_ids, logprobs, states)
        output.prompt_logprobs = prompt_logprobs
        return output

    def compute_logits_for(self, scheduler_output: SchedulerOutput, all_tokens: bool = False) -> torch.Tensor:
        """Run the step (writing its K/V) and return float32 logits without sampling.

        Rows are the sampling positions in `scheduled` order, or with `all_tokens` every new token
        of every scheduled sequence, sequence after sequence in `scheduled` order.
        """
        with torch.inference_mode():
            inputs, hidden = self._forward(scheduler_output.scheduled)
            if not all_tokens:
                return self._logits_for_sampling(scheduler_output.scheduled, inputs, hidden)[0]
            rows = torch.cat([torch.arange(start, end) for start, end in inputs.row_ranges])
            return self.model.compute_logits(hidden[rows.to(self.device)])

    def warmup(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        """Drive the largest step shapes once so allocations and kernel choices happen before serving.

        It writes K/V into the first blocks as scratch; no block table refers to them afterwards,
        so the cache stays logically empty.
        """
        capacity = self.num_blocks * self.block_size
        prompt_length = max(2, min(max_num_batched_tokens, capacity - 1))
        table = list(range(min(self.num_blocks, -(-(prompt_length + 1) // self.block_size))))
        # Greedy, so warming up leaves the sampler's shared random generator untouched.
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def scheduled(seq_id: int, token_ids: list[int], start: int) -> ScheduledSequence:
            return ScheduledSequence(
                seq_id=seq_id,
                token_ids=token_ids,
                start_position=start,
                block_table=table,
                sample=True,
                sampling_params=params,
                prompt_token_ids=[0] * (start + len(token_ids)),
                output_token_ids=[],
            )

        self.execute(SchedulerOutput(scheduled=[scheduled(-1, [0] * prompt_length, 0)]))
        decodes = [scheduled(-2 - i, [0], prompt_length - 1) for i in range(max_num_seqs)]
        self.execute(SchedulerOutput(scheduled=decodes))

    def _forward(self, scheduled: list[ScheduledSequence]) -> tuple[_StepInputs, torch.Tensor]:
        inputs = self._prepare(scheduled)
        return inputs, self.model(inputs.input_ids, inputs.positions, inputs.metadata)

    def _logits_for_sampling(self, scheduled: list[ScheduledSequence], inputs: _StepInputs,
                             hidden: torch.Tensor) -> tuple[torch.Tensor, list[ScheduledSequence]]:
        requests: list[ScheduledSequence] = []
        rows: list[int] = []
        for item, (_, end) in zip(scheduled, inputs.row_ranges, strict=True):
            if item.sample:
                item_rows = sampling_rows(item)  # the last token, or every position of a draft run
                requests.extend(item_rows)
                rows.extend(range(end - len(item_rows), end))
        if not requests:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32), requests
        if rows != list(range(hidden.shape[0])):
            hidden = hidden[torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)]
        return self.model.compute_logits(hidden), requests

    def _prompt_logprobs(self, scheduled: list[ScheduledSequence], inputs: _StepInputs,
                         hidden: torch.Tensor) -> list[PromptLogprobs]:
        """For sequences that asked: the logprob of each prompt token this chunk predicts (a row at
        position p predicts the prompt token at p + 1), with its top alternatives."""
        results = []
        for item, (row_start, _) in zip(scheduled, inputs.row_ranges, strict=True):
            num_top = item.sampling_params.prompt_logprobs
            if num_top is None:  # almost every sequence of every step: nothing to compute
                continue
            # Positions start..last predict prompt tokens start+1..last+1; the prompt's last position
            # predicts the first output token instead.
            last = min(item.start_position + item.num_new_tokens, len(item.prompt_token_ids) - 1)
            if last <= item.start_position:
                continue
            count = last - item.start_position
            rows = torch.arange(row_start, row_start + count, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            targets = item.prompt_token_ids[item.start_position + 1:last + 1]
            results.append(PromptLogprobs(item.seq_id, item.start_position + 1,
                                          compute_logprobs(logits, targets, [num_top] * count)))
        return results

    def _prepare(self, scheduled: list[ScheduledSequence]) -> _StepInputs:
        # One-token sequences form the batched decode group, whatever the scheduler's order. A sequence
        # verifying drafts joins it as one row per new token (row i sees the cache up to its own position:
        # every new K/V is written before attention), so verification batches like decoding.
        def in_decode_group(item: ScheduledSequence) -> bool:
            return item.num_new_tokens == 1 or bool(item.draft_token_ids)

        # Decodes by context length, so attention buckets of similar contexts are contiguous rows.
        order = sorted((i for i, s in enumerate(scheduled) if in_decode_group(s)),
                       key=lambda i: scheduled[i].start_position)
        order += [i for i, s in enumerate(scheduled) if not in_decode_group(s)]
        ordered = [scheduled[i] for i in order]
        lengths: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        for item in ordered:
            if item.draft_token_ids:
                lengths += [1] * item.num_new_tokens
                starts += range(item.start_position, item.start_position + item.num_new_tokens)
                tables += [item.block_table] * item.num_new_tokens
            else:
                lengths.append(item.num_new_tokens)
                starts.append(item.start_position)
                tables.append(item.block_table)
        metadata, positions = build_attention_metadata(lengths, starts, tables, self.block_size, self.device,
                                                       null_slot=self.null_slot, native=self.native_attention)
        token_ids = [token for s in ordered for token in s.token_ids]
        input_ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        row_ranges: list[tuple[int, int]] = [(0, 0)] * len(scheduled)
        row = 0
        for index, sequence in zip(order, ordered, strict=True):
            row_ranges[index] = (row, row + sequence.num_new_tokens)
            row += sequence.num_new_tokens
        return _StepInputs(input_ids, positions, metadata, row_ranges)
