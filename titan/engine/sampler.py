"""Turns one step's logits into next tokens: penalties, bans, temperature, min-p/top-k/top-p, seeds.

Order follows vLLM: allowed_token_ids, logit_bias, grammar masks (structured outputs), min_tokens bans
and penalties shape the logits that greedy decoding argmaxes over; random rows then apply temperature,
min-p, top-k and top-p before drawing. Logprobs always describe the raw model distribution.

Random rows are drawn by inverting the CDF over token ids with one uniform number per row. The uniform
of a seeded request comes only from its own generator and every filter is computed row by row, so its
tokens do not depend on the rest of the batch or its row index. One number per row also keeps the
random-number cost independent of the vocabulary size.
"""

from __future__ import annotations

import numpy as np
import torch

from titan.engine.scheduler_output import ScheduledSequence, TokenLogprobs
from titan.engine.structured import apply_grammar_masks

# Below this temperature a row is decoded greedily (dividing by it would overflow).
GREEDY_TEMPERATURE = 1e-5
# top-k/top-p look at this many most likely tokens first, then widen, sorting the whole vocabulary only
# for rows whose kept set is wider still: a full sort costs far more than a small top-k.
_CANDIDATE_WIDTHS = (256, 4096)
# The inverse CDF first picks a block of this many token ids, then a token inside it, so no
# batch x vocabulary float64 buffer is needed.
_CDF_BLOCK = 256


def process_logits(
    logits: torch.Tensor, requests: list[ScheduledSequence], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """Float32 logits after min_tokens bans and repetition/presence/frequency penalties.

    Returns a new tensor when anything changes (the input is never modified); this is what greedy
    decoding argmaxes over.
    """
    processed = logits.float()
    ban_rows, ban_ids = _min_tokens_bans(requests, eos_token_ids, logits.shape[-1])
    word_rows, word_ids = _bad_word_bans(requests, logits.shape[-1])
    ban_rows, ban_ids = ban_rows + word_rows, ban_ids + word_ids
    penalty_rows = [i for i, request in enumerate(requests) if _has_penalties(request)]
    bias_rows = [i for i, request in enumerate(requests) if request.sampling_params.logit_bias]
    grammar_rows = [i for i, request in enumerate(requests) if request.grammar is not None]
    allowed_rows = [i for i, request in enumerate(requests) if request.sampling_params.allowed_token_ids]
    if not ban_rows and not penalty_rows and not bias_rows and not grammar_rows and not allowed_rows:
        return processed
    if processed is logits:
        processed = processed.clone()
    for row in allowed_rows:
        _keep_only(processed[row], requests[row].sampling_params.allowed_token_ids or [])
    if bias_rows:
        _apply_logit_bias(processed, [requests[i] for i in bias_rows], bias_rows)
    if grammar_rows:
        apply_grammar_masks(processed, grammar_rows, [requests[i].grammar for i in grammar_rows])
    if ban_rows:
        rows = torch.tensor(ban_rows, device=logits.device)
        ids = torch.tensor(ban_ids, device=logits.device)
        processed[rows, ids] = float("-inf")
    if penalty_rows:
        _apply_penalties(processed, [requests[i] for i in penalty_rows], penalty_rows)
    return processed


def _keep_only(row: torch.Tensor, token_ids: list[int]) -> None:
    """Every logit of `row` but those of `token_ids` to -inf (ids past the vocabulary are ignored)."""
    banned = torch.ones(row.shape[-1], dtype=torch.bool, device=row.device)
    banned[torch.tensor([t for t in token_ids if t < row.shape[-1]], dtype=torch.long, device=row.device)] = False
    row.masked_fill_(banned, float("-inf"))


def _apply_logit_bias(processed: torch.Tensor, requests: list[ScheduledSequence], rows: list[int]) -> None:
    """Add each request's logit_bias to its row (OpenAI: -100 bans a token, 100 all but forces it)."""
    vocab_size = processed.shape[-1]
    pairs = [(row, token, bias) for row, request in zip(rows, requests, strict=True)
             for token, bias in (request.sampling_params.logit_bias or {}).items() if token < vocab_size]
    if pairs:
        row_ids, token_ids, biases = zip(*pairs, strict=True)
        device = processed.device
        processed.index_put_((torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)),
                             torch.tensor(biases, device=device, dtype=processed.dtype), accumulate=True)


def _min_tokens_bans(
    requests: list[ScheduledSequence], eos_token_ids: frozenset[int], vocab_size: int
) -> tuple[list[int], list[int]]:
    """(row, token) pairs to ban: EOS and stop tokens while a request is short of min_tokens."""
    rows: list[int] = []
    ids: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            continue
        for token_id in eos_token_ids.union(params.stop_token_ids):
            if 0 <= token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
    return rows, ids


def _bad_word_bans(requests: list[ScheduledSequence], vocab_size: int) -> tuple[list[int], list[int]]:
    """(row, token) pairs to ban: the last token of each bad word whose other tokens the output ends with."""
    rows: list[int] = []
    ids: list[int] = []
    for row, request in enumerate(requests):
        for word in request.sampling_params.bad_words_token_ids or ():
            *head, last = word
            output = request.output_token_ids
            if last < vocab_size and (not head or output[len(output) - len(head):] == head):
                rows.append(row)
                ids.append(last)
    return rows, ids


def _has_penalties(request: ScheduledSequence) -> bool:
    params = request.sampling_params
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _token_hits(
    rows: list[int], token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, token id) index tensors with one entry per in-range token of each row's list."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    token_ids = torch.tensor([token for tokens in token_lists for token in tokens], dtype=torch.long)
    in_range = (token_ids >= 0) & (token_ids < vocab_size)
    return row_ids[in_range].to(device), token_ids[in_range].to(device)


def _apply_penalties(processed: torch.Tensor, requests: list[ScheduledSequence], rows: list[int]) -> None:
    """Penalize rows `rows` of `processed` in place; `requests` are those rows' requests.

    Only tokens that occur in a request's history change, so the work scales with history length
    rather than batch x vocabulary.
    """
    vocab_size = processed.shape[-1]
    device = processed.device
    params = [request.sampling_params for request in requests]

    repeating = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeating:
        hit_rows, hit_ids = _token_hits(
            [rows[i] for i in repeating],
            [requests[i].prompt_token_ids + requests[i].output_token_ids for i in repeating],
            vocab_size, device)
        penalty_by_row = torch.ones(processed.shape[0], device=device)
        penalty_by_row[[rows[i] for i in repeating]] = torch.tensor(
            [params[i].repetition_penalty for i in repeating], device=device)
        penalty = penalty_by_row[hit_rows]
        values = processed[hit_rows, hit_ids]
        # HF convention: shrink positive logits, push negative ones further down. Repeated hits
        # write the same value, so duplicates are harmless.
        processed[hit_rows, hit_ids] = torch.where(values > 0, values / penalty, values * penalty)

    counting = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if counting:
        hit_rows, hit_ids = _token_hits(
            [rows[i] for i in counting], [requests[i].output_token_ids for i in counting], vocab_size, device)
        if hit_rows.numel() == 0:
            return
        pairs, counts = torch.unique(hit_rows * vocab_size + hit_ids, return_counts=True)
        pair_rows = pairs // vocab_size
        presence_by_row = torch.zeros(processed.shape[0], device=device)
        frequency_by_row = torch.zeros(processed.shape[0], device=device)
        counting_rows = [rows[i] for i in counting]
        presence_by_row[counting_rows] = torch.tensor(
            [params[i].presence_penalty for i in counting], device=device)
        frequency_by_row[counting_rows] = torch.tensor(
            [params[i].frequency_penalty for i in counting], device=device)
        adjustment = presence_by_row[pair_rows] + frequency_by_row[pair_rows] * counts
        processed.index_put_((pair_rows, pairs % vocab_size), -adjustment, accumulate=True)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero (in place) tokens whose probability is below min_p times the row's top probability."""
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill_(probs < threshold, 0.0)


def apply_top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero (in place) all outside each row's top-k (0 = off), then outside the nucleus of mass top_p.

    `probs` may be unnormalized (after min-p). Both filters become a per-row probability threshold,
    so tokens tied with the last kept one are kept too, independent of sort order.
    """
    vocab_size = probs.shape[-1]
    device = probs.device
    k_limit = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_k], device=device)
    p_limit = torch.tensor(top_p, device=device, dtype=torch.float32)
    # Without top-k, top-p is relative to the whole (possibly min-p reduced) mass.
    total_mass = torch.where(k_limit < vocab_size, float("nan"), probs.sum(dim=-1))

    # Look at the few most likely tokens first and widen only for rows whose kept set fills the view;
    # a row's threshold is the same at any width, so the batch does not change it.
    threshold = torch.empty(probs.shape[0], device=device, dtype=probs.dtype)
    pending = torch.arange(probs.shape[0], device=device)
    for width in [w for w in _CANDIDATE_WIDTHS if w < vocab_size] + [vocab_size]:
        rows = probs if pending.numel() == probs.shape[0] else probs.index_select(0, pending)
        if width < vocab_size:
            descending = rows.topk(width, dim=-1).values
        else:
            descending = rows.sort(dim=-1, descending=True).values
        row_threshold, num_kept = _nucleus_threshold(
            descending, k_limit[pending], p_limit[pending], total_mass[pending])
        # A row is settled unless its kept set may run past the view; a top-k wider than the view
        # also means the mass top-p is relative to is not known yet.
        unresolved = (k_limit[pending] > width) & ((num_kept == width) | total_mass[pending].isnan())
        resolved = ~unresolved
        threshold[pending[resolved]] = row_threshold[resolved]
        pending = pending[unresolved]
        if pending.numel() == 0:
            break
    return probs.masked_fill_(probs < threshold.unsqueeze(1), 0.0)


def _nucleus_threshold(
    descending: torch.Tensor, k_limit: torch.Tensor, p_limit: torch.Tensor, total_mass: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept probability and the number of kept positions, given each row's sorted probs.

    `total_mass` is NaN for rows with top-k, whose top-p mass is what top-k kept.
    """
    positions = torch.arange(descending.shape[-1], device=descending.device)
    in_top_k = positions.unsqueeze(0) < k_limit.unsqueeze(1)
    top_k_probs = descending * in_top_k
    cumulative = top_k_probs.cumsum(dim=-1)
    mass = torch.where(total_mass.isnan(), cumulative[:, -1], total_mass)
    before = cumulative - top_k_probs
    in_nucleus = (before < (p_limit * mass).unsqueeze(1)) | (p_limit >= 1.0).unsqueeze(1)
    num_kept = (in_top_k & in_nucleus).sum(dim=-1).clamp(min=1)
    threshold = descending.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    return threshold, num_kept


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Invert each row's CDF over token ids at uniforms in [0, 1); probs may be unnormalized.

    Zero-probability tokens are never returned for a row with positive mass.
    """
    vocab_size = probs.shape[-1]
    device = probs.device
    # unfold views the whole blocks without copying; the last, partial block (possibly empty) is summed apart.
    parts = [probs[:, vocab_size - vocab_size % _CDF_BLOCK:].sum(dim=-1, keepdim=True)]
    if vocab_size >= _CDF_BLOCK:
        parts.insert(0, probs.unfold(1, _CDF_BLOCK, _CDF_BLOCK).sum(dim=-1))
    block_sums = torch.cat(parts, dim=1).double()
    block_cdf = block_sums.cumsum(dim=-1)
    target = _below_total(uniforms.to(device).unsqueeze(1) * block_cdf[:, -1:], block_cdf[:, -1:])
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    offset = target - (block_cdf.gather(1, block) - block_sums.gather(1, block))

    columns = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=device)
    inside = columns < vocab_size
    inner_cdf = (probs.gather(1, columns.clamp(max=vocab_size - 1)) * inside).double().cumsum(dim=-1)
    offset = _below_total(offset, inner_cdf[:, -1:])
    position = torch.searchsorted(inner_cdf, offset, right=True).clamp_(max=_CDF_BLOCK - 1)
    return (block * _CDF_BLOCK + position).squeeze(1).clamp_(max=vocab_size - 1)


def _below_total(target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Keep a search target strictly below the CDF's total so it never lands past the last nonzero."""
    return torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))


def compute_logprobs(
    raw_logits: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[TokenLogprobs]:
    """Logprob and rank of each row's token under log_softmax(raw_logits), plus its top-N alternatives."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    max_top = max(num_top)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top > 0 else (logprobs[:, :0], chosen[:, :0])

    chosen_list = chosen_logprobs.squeeze(1).tolist()
    rank_list = ranks.tolist()
    value_rows = top_values.tolist()
    id_rows = top_ids.tolist()
    return [
        TokenLogprobs(token_id=token_ids[row], logprob=chosen_list[row], rank=rank_list[row],
                      top=list(zip(id_rows[row][:count], value_rows[row][:count], strict=True)))
        for row, count in enumerate(num_top)
    ]


def row_argmax(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, index of the first max) of each row; NaN counts as the max, as in torch.max. On the CPU
    through numpy: torch's reduction took 44 us for one 49k-vocabulary row and 1.3 ms for 64 (numpy 4 us
    and 0.2 ms), on every decode step."""
    if values.device.type != "cpu" or values.dtype != torch.float32 or values.requires_grad:
        return values.max(dim=-1)
    array = values.numpy()
    index = array.argmax(axis=-1)  # the first occurrence: ties resolve to the lowest token id
    return torch.from_numpy(array[np.arange(array.shape[0]), index]), torch.from_numpy(index)


class Sampler:
    """Picks one token per sampling row; unseeded rows share a generator seeded by `seed`."""

    def __init__(self, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, requests: list[ScheduledSequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        if not requests:
            return [], []
        processed = process_logits(logits, requests, self.eos_token_ids)
        row_max, tokens = row_argmax(processed)

        random_rows = [i for i, request in enumerate(requests)
                       if request.sampling_params.temperature >= GREEDY_TEMPERATURE]
        if random_rows:
            sampled = self._sample_random(processed, [requests[i] for i in random_rows], random_rows)
            tokens = tokens.index_copy(0, torch.tensor(random_rows, device=tokens.device), sampled)

        # Everything banned, NaN or +inf in a row: fall back to the raw argmax rather than garbage.
        valid = torch.isfinite(row_max)
        token_list, valid_list = torch.stack([tokens, valid.long()]).tolist()
        for row, ok in enumerate(valid_list):
            if not ok:
                token_list[row] = int(logits[row].float().nan_to_num(nan=float("-inf")).argmax())

        logprob_rows = [i for i, request in enumerate(requests)
                        if request.sampling_params.logprobs is not None]
        results: list[TokenLogprobs | None] = [None] * len(requests)
        if logprob_rows:
            raw = logits
            if len(logprob_rows) < len(requests):
                raw = logits.index_select(0, torch.tensor(logprob_rows, device=logits.device))
            computed = compute_logprobs(raw, [token_list[i] for i in logprob_rows],
                                        [requests[i].sampling_params.logprobs or 0 for i in logprob_rows])
            for row, entry in zip(logprob_rows, computed, strict=True):
                results[row] = entry
        return token_list, results

    def _sample_random(
        self, processed: torch.Tensor, requests: list[ScheduledSequence], rows: list[int]
    ) -> torch.Tensor:
        device = processed.device
        params = [request.sampling_params for request in requests]
        selected = processed
        if len(rows) < processed.shape[0]:
            selected = processed.index_select(0, torch.tensor(rows, device=device))
        if any(p.temperature != 1.0 for p in params):
            selected = selected / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        probs = torch.softmax(selected, dim=-1)  # a fresh tensor, so later filters may work in place
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(probs, torch.tensor([p.min_p for p in params], device=device))
        filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if len(filtered) == len(params):
            apply_top_k_top_p(probs, [p.top_k for p in params], [p.top_p for p in params])
        elif filtered:
            index = torch.tensor(filtered, device=device)
            subset = probs.index_select(0, index)
            apply_top_k_top_p(subset, [params[i].top_k for i in filtered], [params[i].top_p for i in filtered])
            probs.index_copy_(0, index, subset)
        return sample_from_probs(probs, self._draw_uniforms(requests))

    def _draw_uniforms(self, requests: list[ScheduledSequence]) -> torch.Tensor:
        """One uniform per row: from the request's own generator when seeded, else the shared one."""
        uniforms = torch.empty(len(requests), dtype=torch.float64)
        unseeded = [i for i, request in enumerate(requests) if request.generator is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=self._generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                uniforms[i] = draw_uniform(request.generator)
        return uniforms


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """The next uniform of a request's own generator (one per sampled position; verify rewinds by it)."""
    return torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)[0]
