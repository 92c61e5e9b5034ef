"""The OpenAI-compatible HTTP server (`titan serve`); see app.py for the endpoints, async_engine.py for
how the engine thread and the event loop share the cores, serve.py for startup and draining."""
