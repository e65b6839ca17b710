"""`npuspec serve`: an OpenAI-compatible HTTP server over the offline engine (docs/serving.md).

    args.py      the server's flags (vllm serve's), checked, and the LLM they build
    app.py       FastAPI routes, SSE streaming, API key, error bodies
    protocol.py  OpenAI request bodies -> engine requests (every field honoured or refused)
    core.py      the engine process: owns the LLM, runs LLM.step(), one message per step
    engine.py    its HTTP-side client: checked requests, the pipe, asyncio queues per request
    text.py      incremental detokenisation and stop strings
    chat.py      the checkpoint's chat template (Jinja2, as HF renders it)
    metrics.py   Prometheus metrics, vLLM's names under the npuspec: prefix

Needs the [serve] extra (fastapi, uvicorn, prometheus_client, jinja2). See docs/serving.md.
The `npuspec serve` subcommand (npuspec/cli/serve.py) starts it; the package imports nothing
from npuspec.cli.
"""
