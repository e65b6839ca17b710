"""Serve a model over an OpenAI-compatible HTTP API, with speculative decoding (`vllm serve`'s flags).

    npuspec serve tiny --port 8000 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "def fib(n):", "max_tokens": 32}'

Routes: /v1/completions, /v1/chat/completions (streamed with "stream": true), /v1/models,
/health, /metrics (Prometheus). One engine loop batches every connection's requests
continuously; SIGTERM (or Ctrl-C) stops accepting connections, finishes the requests in
flight, then exits. Needs the [serve] extra: pip install 'npuspec[serve]'.
"""
from __future__ import annotations

from npuspec.serve.args import add_arguments, check_flags  # the flags are the server's

__all__ = ["add_arguments", "run"]


def run(args) -> int:
    check_flags(args)
    from npuspec.cli import serve_run  # heavy: keeps `--help` and flag errors off torch's import
    return serve_run.run(args)
