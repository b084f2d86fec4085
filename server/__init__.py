"""`python engine.py serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    loop.py      the engine's step loop in a background thread; per-request async streams
    protocol.py  OpenAI request bodies -> token ids + SamplingParams; response and chunk bodies
    metrics.py   Prometheus metrics of the engine and the cache
    app.py       the routes, auth, limits, error bodies and graceful shutdown (Starlette + uvicorn)
"""
