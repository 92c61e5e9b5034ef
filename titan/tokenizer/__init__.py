"""Tokenizers: GGUF -> HF conversion, encode/decode, chat templates and streaming detokenization."""

from titan.tokenizer.detokenizer import IncrementalDetokenizer
from titan.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
