"""Server defaults shared by the flags and the app (no heavy imports here)."""

# Far above any real prompt (a full 8k-token context as JSON token ids is ~60 KB), far below harm.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Kubernetes waits 30 s by default between SIGTERM and SIGKILL; finish inside that.
DEFAULT_DRAIN_TIMEOUT_SECONDS = 25.0
