"""The default model on its quantized kernels (--quantization auto) against the same numbers dequantized
to float32 (--quantization none): teacher-forced top-1 agreement and greedy generations."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from titan.engine.model_runner import ModelRunner
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from titan.entrypoints.llm import LLM
from titan.kernels import QuantizedTensor, native, ops
from titan.loader import load_model_files
from titan.tokenizer import Tokenizer

BLOCK_SIZE = 16
CHUNK = 128  # prefill chunk: wide steps (dequantized tiles into a GEMM)
# Texts fed a few tokens per step go through the fused integer kernels (narrow steps) instead.
NARROW_CHUNKS = {5: 1, 3: 4, 1: 8, 7: 8, 9: 16}

# Varied text: prose, code, numbers, a list, dialogue, another language, and a chat-formatted turn.
TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Within fifty "
    "years, presses operated in more than two hundred European cities, and the price of books fell sharply. "
    "Scholars argue about how quickly literacy followed, but few doubt that the spread of cheap pamphlets "
    "changed religious and political debate. Newspapers appeared in the seventeenth century; by the "
    "nineteenth, steam-driven rotary presses printed thousands of sheets an hour.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n    merged = []\n"
    "    i = j = 0\n    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n            i += 1\n        else:\n            merged.append(right[j])\n"
    "            j += 1\n    merged.extend(left[i:])\n    merged.extend(right[j:])\n    return merged\n\n"
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n"
    "        self._items.append(item)\n\n    def pop(self):\n        return self._items.pop()\n",
    "Quarterly results: revenue rose 12.4% to $3.27 billion, operating margin was 18.9%, and the company "
    "repurchased 4.1 million shares at an average price of $87.35. Guidance for the year: 2,450 to 2,600 "
    "units, capital expenditure near $410 million. In 2023 the figures were 2,180 units and $365 million.",
    "Shopping list:\n1. Two litres of milk\n2. A loaf of sourdough bread\n3. Six eggs\n4. Tomatoes, "
    "onions and garlic\n5. Olive oil\n6. Coffee beans, medium roast\n7. Washing-up liquid\n",
    "\"Are you coming to the station?\" asked Maria.\n\"Only if the rain stops,\" Tom replied, looking at "
    "the grey sky. \"Last time I waited an hour for a train that never came.\"\n\"This time it will be "
    "different. The timetable changed on Monday, and the new trains are faster.\"",
    "La photosynthèse est le processus par lequel les plantes vertes transforment la lumière du soleil en "
    "énergie chimique. Elle se déroule principalement dans les feuilles, à l'intérieur des chloroplastes.",
    "Water is made of two hydrogen atoms and one oxygen atom. It freezes at 0 degrees Celsius and boils "
    "at 100 degrees at sea level. Because the molecule is polar, water dissolves many salts and sugars, "
    "which is why it is sometimes called the universal solvent. Ice floats because it is less dense than "
    "liquid water, so lakes freeze from the top down and fish survive the winter below.",
    '{"id": 4711, "name": "Ada Lovelace", "email": "ada@example.org", "roles": ["admin", "editor"], '
    '"created": "2024-03-18T09:41:00Z", "settings": {"theme": "dark", "notifications": false}}\n'
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent FROM orders WHERE created_at >= "
    "'2024-01-01' GROUP BY customer_id HAVING COUNT(*) > 3 ORDER BY spent DESC LIMIT 20;",
    "To make a simple tomato soup, soften a chopped onion and two cloves of garlic in olive oil over a "
    "low heat for ten minutes. Add a kilogram of ripe tomatoes, a teaspoon of sugar, salt and pepper, and "
    "half a litre of vegetable stock. Simmer for twenty minutes, then blend until smooth. Stir in a little "
    "cream or a spoonful of yoghurt, taste, and adjust the seasoning before serving with warm bread.",
    "The mitochondrion is often described as the powerhouse of the cell. It produces most of the cell's "
    "supply of adenosine triphosphate, which is used as a source of chemical energy. Mitochondria have "
    "their own small genome, inherited from the mother, and they divide independently of the cell. Many "
    "biologists think they descend from bacteria that were engulfed by an ancestral cell two billion "
    "years ago, an idea known as the endosymbiotic theory.",
    "In the beginning the network was small: a handful of universities connected by leased telephone "
    "lines. Engineers wrote the first protocols in plain documents called requests for comments, and "
    "anyone could propose a change. When electronic mail arrived it quickly became the most popular "
    "service, long before the first web page was published. Today billions of devices exchange packets "
    "every second, yet many of the original ideas, such as best-effort delivery and end-to-end design, "
    "remain at the heart of the system.",
    "User: My laptop battery drains very quickly. What can I do?\nAssistant: First, lower the screen "
    "brightness and close applications you are not using, especially web browsers with many tabs. Check "
    "the battery settings for apps that use a lot of power in the background. Turning off Bluetooth and "
    "keyboard backlighting also helps. If the battery is several years old, its capacity may have dropped, "
    "and replacing it is often the best solution.",
]
GREEDY_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give three tips for staying healthy.",
    "Explain what a black hole is in one paragraph.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def runners() -> Iterator[tuple[ModelRunner, ModelRunner, Tokenizer]]:
    quantized_files = load_model_files("default", "auto")
    float_files = load_model_files("default", "none")
    assert any(isinstance(t, QuantizedTensor) for t in quantized_files.weights.values())
    assert not any(isinstance(t, QuantizedTensor) for t in float_files.weights.values())
    made = []
    for files in (quantized_files, float_files):
        made.append(ModelRunner(files.config, files.weights, 160, BLOCK_SIZE, torch.device("cpu"), torch.float32,
                                sampler=None))  # type: ignore[arg-type]
    yield made[0], made[1], Tokenizer.from_folder(quantized_files.folder)


def teacher_forced_logits(runner: ModelRunner, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position, the sequence fed in steps of the given sizes (one sequence, blocks 0..)."""
    table = list(range(-(-len(tokens) // BLOCK_SIZE)))
    logits, start = [], 0
    for size in chunks:
        end = min(start + size, len(tokens))
        step = ScheduledSequence(
            seq_id=0,
            token_ids=tokens[start:end],
            start_position=start,
            block_table=table[: -(-end // BLOCK_SIZE)],
            sample=False,
            sampling_params=SamplingParams(temperature=0.0),
            prompt_token_ids=tokens[:end],
            output_token_ids=[],
        )
        logits.append(runner.compute_logits_for(SchedulerOutput([step]), all_tokens=True))
        start = end
        if start == len(tokens):
            break
    return torch.cat(logits)


def top1_agreement(runner: ModelRunner, reference: ModelRunner, tokenizer: Tokenizer) -> tuple[int, int]:
    """Positions of TEXTS where the two runners' argmaxes agree, and all positions, fed the same chunks."""
    agree = total = 0
    for index, text in enumerate(TEXTS):
        tokens = tokenizer.encode(text)[:2000]
        # Half the texts in wide chunks, half a few tokens per step (decode-sized: the fused kernels).
        size = NARROW_CHUNKS.get(index, CHUNK)
        chunks = [size] * (-(-len(tokens) // size))
        got = teacher_forced_logits(runner, tokens, chunks).argmax(-1)
        expected = teacher_forced_logits(reference, tokens, chunks).argmax(-1)
        agree += int((got == expected).sum())
        total += len(tokens)
    return agree, total


def test_teacher_forced_top1_agreement(runners: tuple[ModelRunner, ModelRunner, Tokenizer]) -> None:
    quantized, reference, tokenizer = runners
    agree, total = top1_agreement(quantized, reference, tokenizer)
    print(f"teacher-forced top-1 agreement: {agree}/{total} = {agree / total:.4f}")  # shown with -s
    assert total >= 1000
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"


def test_opt_in_bf32_wide_steps_top1_agreement(runners: tuple[ModelRunner, ModelRunner, Tokenizer],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """TITAN_WIDE_BF32=1: steps of 256 rows multiply in oneDNN's bf32 mode (bfloat16 products, float32 sums and
    output; AMX where the CPU has it), and still agree with the float32 model position for position."""
    quantized, reference, tokenizer = runners
    tokens = tokenizer.encode(" ".join(TEXTS))[:1024]
    chunks = [256] * (-(-len(tokens) // 256))
    assert len(tokens) >= 768 and 256 >= ops.WIDE_BF32_MIN_ROWS
    default = teacher_forced_logits(quantized, tokens[:256], [256])
    monkeypatch.setattr(ops, "wide_bf32", lambda: True)
    if native() is not None and {"amx-bf16", "avx512bf16"} & set(native().cpu_features()):
        assert not torch.equal(teacher_forced_logits(quantized, tokens[:256], [256]), default)  # the path ran
    got = teacher_forced_logits(quantized, tokens, chunks).argmax(-1)
    expected = teacher_forced_logits(reference, tokens, chunks).argmax(-1)
    agree = int((got == expected).sum())
    print(f"bf32 wide steps teacher-forced top-1 agreement: {agree}/{len(tokens)}")  # -s shows it
    assert agree / len(tokens) >= 0.99, f"top-1 agreement {agree}/{len(tokens)}"


def test_float16_kv_cache_top1_agreement(runners: tuple[ModelRunner, ModelRunner, Tokenizer]) -> None:
    """--kv-cache-dtype float16 against the float32 cache, both on the quantized kernels, the same texts and
    chunks: K/V rounded to fp16 (10-bit mantissa) move the logits by rounding noise only."""
    float32_cache, _, tokenizer = runners
    files = load_model_files("default", "auto")
    float16_cache = ModelRunner(files.config, files.weights, 160, BLOCK_SIZE, torch.device("cpu"), torch.float32,
                                sampler=None, kv_cache_dtype=torch.float16)  # type: ignore[arg-type]
    agree, total = top1_agreement(float16_cache, float32_cache, tokenizer)
    print(f"fp16 KV cache teacher-forced top-1 agreement: {agree}/{total} = {agree / total:.4f}")  # -s shows it
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"


def test_greedy_generations_match() -> None:
    """Identical on at least 4 of 5 prompts x 32 tokens: a near-tie of the two argmaxes may flip one."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = {}
    for quantization in ("auto", "none"):
        llm = LLM("default", quantization=quantization, kv_cache_memory=0.05)
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in GREEDY_PROMPTS]
        outputs[quantization] = [out.token_ids for out in llm.generate(prompts, params)]
        del llm
    same = sum(a == b for a, b in zip(outputs["auto"], outputs["none"], strict=True))
    print(f"greedy generations identical: {same} of 5")  # shown with -s
    assert all(len(tokens) == 32 for tokens in outputs["auto"])
    assert same >= 4, f"{same} of 5 greedy generations identical"


@pytest.mark.skipif(native() is None, reason="native kernels could not be built")
def test_quantized_layers_hold_no_float_weights(runners: tuple[ModelRunner, ModelRunner, Tokenizer]) -> None:
    quantized, _, _ = runners
    model = quantized.model
    assert model.lm_head.quantized is not None and model.lm_head.quantized[0] is model.embed_tokens.quantized
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert float_bytes < 2**20  # norms only: every matrix lives in its GGML bytes
