"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the sequence's suffix.

Copy-heavy outputs (rewrites, code edits, quoting) repeat spans of their prompt or of themselves, so the
continuation of an n-gram seen before is a good guess and costs no model call.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, lookup_max: int, lookup_min: int) -> None:
        self.lookup_max = lookup_max
        self.lookup_min = lookup_min

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts: try the longest suffix first (n = max .. min), latest match wins."""
        if num_tokens <= 0 or len(token_ids) <= self.lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        # Candidate match ends: earlier positions holding the last token (the suffix itself excluded).
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        for n in range(min(self.lookup_max, last), self.lookup_min - 1, -1):
            valid = ends[ends >= n - 1]
            if valid.size == 0:
                continue
            windows = tokens[valid[:, None] - np.arange(n - 1, -1, -1)]
            matches = valid[(windows == tokens[last - n + 1:]).all(axis=1)]
            if matches.size:
                start = int(matches[-1]) + 1
                return tokens[start:start + num_tokens].tolist()
        return []
