"""`npuspec serve`'s run: the socket, the engine process, the app, uvicorn (its flags:
npuspec/serve/args.py; its documentation: npuspec/cli/serve.py)."""
from __future__ import annotations

import signal
import socket
import sys

import torch

from npuspec.cli_util.errors import MissingExtra, UsageError
from npuspec.serve.app import build_app
from npuspec.serve.chat import load_chat_template, missing_reason
from npuspec.serve.engine import EngineClient
from npuspec.serve.metrics import ServerMetrics


def _require_serve_extra() -> None:
    for mod, pkg in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"),
                     ("prometheus_client", "prometheus_client"), ("jinja2", "jinja2")):
        try:
            __import__(mod)
        except ImportError:
            raise MissingExtra(pkg, "serve", "npuspec serve") from None


def run(args) -> int:
    _require_serve_extra()
    import uvicorn  # the [serve] extra, checked just above

    sock = _bind(args.host, args.port)  # before the model loads: a taken port fails at once
    names = args.served_model_name or [args.model]
    host, port = sock.getsockname()[:2]
    # the address first (with --port 0 the caller learns the port); /health answers 200 once
    # the model is loaded and warmed up
    print(f"npuspec serve: {names[0]} on http://{host}:{port}", flush=True)
    torch.set_num_threads(1)  # this process parses and streams; the engine process computes
    client = EngineClient(args)  # starts the engine process; returns once it is loaded
    try:
        template = load_chat_template(client.model_path) if client.tokenizer is not None else None
        metrics = ServerMetrics(names[0], client.k_max, client.num_blocks)
        app = build_app(client, names, api_key=args.api_key, metrics=metrics,
                        chat_template=template, chat_missing=missing_reason(client.model_path))
    except BaseException:
        client.close(10)
        raise
    print(f"npuspec serve: ready (speculative: {client.spec}, max_model_len "
          f"{client.max_model_len}, max_num_seqs {client.max_num_seqs})", file=sys.stderr,
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False))
    got = []
    # uvicorn handles SIGTERM / SIGINT itself (stop listening, let in-flight responses finish,
    # lifespan shutdown), then re-raises the signal to the handler it found: this one, so a
    # drained server exits 0 instead of dying by the signal's default action
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
    try:
        server.run(sockets=[sock])
    finally:
        client.close(10)  # a no-op after the lifespan's shutdown; else (a failed start) needed
    why = f" on {got[0]}" if got else ""
    print(f"npuspec serve: stopped{why} after draining the requests in flight", file=sys.stderr,
          flush=True)
    return 0


def _bind(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port "
                         f"(0 = any free one) or stop what is using it", "--port") from None
    sock.set_inheritable(True)
    return sock
