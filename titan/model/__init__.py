"""Llama-family model with paged KV cache attention."""

from titan.model.attention import AttentionMetadata, build_attention_metadata, paged_attention
from titan.model.llama import LlamaForCausalLM

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "build_attention_metadata", "paged_attention"]
