"""Greedy parity with HF transformers on the default GGUF, each side loading the file its own way."""

from __future__ import annotations

import pytest
import torch

from titan import LLM, SamplingParams
from titan.loader.resolve import resolve_model_path

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "The three laws of motion are",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = resolve_model_path("default")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def test_greedy_token_ids_match_transformers(hf_model) -> None:
    llm = LLM("default")
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    # min_tokens bans EOS exactly as min_new_tokens does on the HF side.
    ours = llm.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0))
    with torch.inference_mode():
        for ids, output in zip(prompt_ids, ours, strict=True):
            expected = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            assert output.token_ids == expected[0, len(ids):].tolist()
