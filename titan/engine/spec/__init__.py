"""Speculative decoding: drafts proposed after each step, verified by the next one (see planner, verify)."""
