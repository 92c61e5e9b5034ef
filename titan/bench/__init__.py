"""`titan bench`: a load generator and transient report for any OpenAI-compatible server.

It speaks only the OpenAI HTTP API (plus `/metrics` when the server exposes `titan:` or `vllm:` names), so
it never imports torch or the engine.
"""
