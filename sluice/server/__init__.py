"""sluice.server: ``sluice serve``, the OpenAI-compatible API process.

    app.py          build_app(settings, ...): the composition root
    wiring.py       build_app's builders: keys, lanes (engine clients + admission), serving object, lifespan
    routes.py       the request id middleware, error handlers, /health, /metrics and the OpenAI routes
    state.py        ServerState, shared by app.py and the admin routes (admin.py: /admin/kv and the admin-key check,
                    profiling.py: /admin/profile, lora_routes.py: adapter load/unload)
    serving.py      the life of a request: auth, priority, tokenize, admit, submit, finish
    generation.py   engine outputs -> text deltas (detokenize, stop strings, aborts)
    render.py       OpenAI response / SSE chunk shapes
    engine_client.py / engine_proc.py / ipc.py   the engine core process over ZeroMQ
    admission.py    admission by predicted TTFT vs the class's target, lowest class shed first (pure)
    slo.py          per-class TTFT targets (--slo); the TTFT prediction is the engine's (sluice.engine.ttft_model)
    runner.py       uvicorn, SIGTERM drain, exit codes;  cli.py  the ``serve`` command
    testing.py      fake engine core + byte codec for tests
"""
