"""`titan router`: an OpenAI-compatible gateway in front of several Titan (or other OpenAI-compatible) servers.

- config.py: settings from flags and/or a YAML file; args.py: the flags and the CLI handler
- backend.py: one backend's state and the pool that picks among the ready ones
- hash_ring.py, policies.py: round-robin, least-load (power of two choices), prefix-affinity
- request_key.py: the affinity key, cut from the prompt's leading characters
- health.py: readiness polling, load scraping, model lists
- discovery.py: backends that join and leave with a DNS name's addresses (a headless Service's pods)
- proxy.py: forwarding with one retry before the first byte; responses.py: the pass-through after it
- app.py: the ASGI app (routes, lifespan); metrics.py: `titan_router:*`; serve.py: uvicorn
- launcher.py: `titan router` in a child process (tests, benchmarks)
"""
