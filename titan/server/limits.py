"""Server defaults shared by the flags and the app (no heavy imports here)."""

# Far above any real prompt (a full 8k-token context as JSON token ids is ~60 KB), far below harm.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Kubernetes waits 30 s by default between SIGTERM and SIGKILL; finish inside that.
DEFAULT_DRAIN_TIMEOUT_SECONDS = 25.0
# One request of 200 prompts × n=50 once made 10,000 sequences and stalled everyone behind it.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
# Request headers above this (all together) get 431; uvicorn's own default is 16 KiB.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# Texts longer than this are tokenized in a worker thread, so the event loop keeps streaming to
# others meanwhile; shorter ones are cheaper inline than the hand-off (~50 us for 200 characters,
# ~0.6 ms at this limit, measured in benchmarks/serving_overhead.py).
INLINE_TOKENIZE_CHARS = 2048
# Tool-call formats `tool_choice: auto` can parse (titan/server/tools.py).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# `--metrics-prefix`: Titan's own names, or vLLM's for the metrics both have (titan/server/metrics.py).
METRICS_PREFIXES = ("titan", "vllm")
