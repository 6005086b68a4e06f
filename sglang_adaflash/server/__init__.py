"""`adaflash serve`: the reference engine behind an OpenAI-compatible HTTP server.

One module per idea:

- :mod:`.protocol`: the OpenAI wire format (pydantic request models, response and error bodies);
- :mod:`.sse`: server-sent event framing for ``stream: true``;
- :mod:`.textstream`: token ids to text deltas, with stop strings;
- :mod:`.engine_loop`: the one thread that owns the engine (continuous batching, bounded
  admission, aborts, hot-reload swaps between steps, step metrics);
- :mod:`.records`: traffic records of finished requests, written off the hot paths;
- :mod:`.reload`: the SGLang pod's hot reload and admin endpoints, wired to this server;
- :mod:`.app`: the FastAPI routes;
- :mod:`.cli`: the ``serve`` subcommand.

docs/serving.md is the user's guide. FastAPI and uvicorn come with the ``serve`` extra.
"""
