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

import argparse
import json
import signal
import socket
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from npuspec.cli.common import positive

    p.add_argument("model", nargs="?", default="tiny",
                   help="HF checkpoint directory, a llama.cpp .gguf file, or 'tiny' (the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) the API answers to (default: the model argument)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vllm serve's --speculative-config schema, inline JSON or a .json file")
    p.add_argument("--max-model-len", type=positive, default=None, help="context limit per request")
    p.add_argument("--max-num-seqs", type=positive, default=None, help="requests batched at once (default 16)")
    p.add_argument("--max-num-batched-tokens", type=positive, default=None,
                   help="token budget of one engine step (prefill chunks + the verify step)")
    p.add_argument("--tensor-parallel-size", type=positive, default=1)
    p.add_argument("--compilation-config", default=None, metavar="JSON",
                   help="e.g. '{\"cudagraph_capture_sizes\": [5, 10, 20], \"backend\": \"eager\"}'")
    p.add_argument("--additional-config", default=None, metavar="JSON",
                   help="vLLM Ascend's additional_config (rejection_sampler_config, dynamic_spec_config)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="extract_hidden_states: where the hidden-state files go")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graph capture")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument("--seed", type=int, default=0, help="seed of requests that send none")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads")
    p.add_argument("--stream-interval", type=positive, default=1, metavar="N",
                   help="send streamed tokens every N engine steps (first tokens and ends at "
                        "once): smoother streams at 1, more throughput above it")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level")


def _json_flag(value, flag: str):
    from npuspec.cli.errors import UsageError
    if value is None:
        return None
    try:
        d = json.loads(value)
    except json.JSONDecodeError as e:
        raise UsageError(f"not valid JSON ({e.msg} at column {e.colno} of {value!r})", flag) from None
    if not isinstance(d, dict):
        raise UsageError(f"must be a JSON object, got {type(d).__name__} {d!r}", flag)
    return d


def _require_serve_extra() -> None:
    from npuspec.cli.errors import MissingExtra
    for mod, pkg in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"),
                     ("prometheus_client", "prometheus_client"), ("jinja2", "jinja2")):
        try:
            __import__(mod)
        except ImportError:
            raise MissingExtra(pkg, "serve", "npuspec serve") from None


def llm_kwargs(args) -> dict:
    """`LLM(**llm_kwargs(args))`, with every flag that needs no model checked (each error
    names its flag). The HTTP process runs it before it starts the engine process."""
    from npuspec.cli import common
    from npuspec.engine.args import DEFAULT_MAX_NUM_SEQS

    cfg = common.spec_config(args.speculative_config)
    mdir = common.model_dir(args.model)
    common.check_draft(mdir, cfg)
    flags = {"compilation_config": "--compilation-config", "additional_config": "--additional-config",
             "kv_transfer_config": "--kv-transfer-config"}
    kw = {k: _json_flag(getattr(args, k), f) for k, f in flags.items()}
    return dict(model=mdir, speculative_config=cfg.to_dict() if cfg else None,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                max_num_batched_tokens=args.max_num_batched_tokens,
                tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                dtype=args.dtype, seed=args.seed, **kw)


def build_llm(args):
    """The engine (in the engine process, npuspec.serve.core)."""
    from npuspec import LLM
    from npuspec.cli import common

    kw = llm_kwargs(args)
    common.set_threads(args.threads, kw["model"])
    try:
        return LLM(**kw)
    except ValueError as e:  # name the flag: "LLM: max_model_len=..." -> "--max-model-len: ..."
        raise _flag_error(e) from None


def _flag_error(e: ValueError):
    from npuspec.cli.errors import with_field
    msg = str(e)
    for key in ("speculative_config", "additional_config", "compilation_config", "kv_transfer_config",
                "max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                "dtype", "seed"):
        if key in msg:
            return with_field(e, "--" + key.replace("_", "-"))
    return e


def run(args) -> int:
    _require_serve_extra()
    import uvicorn

    from npuspec.serve.app import build_app
    from npuspec.serve.engine import EngineClient
    from npuspec.serve.chat import load_chat_template, missing_reason
    from npuspec.serve.metrics import ServerMetrics

    if not 0 <= args.port <= 65535:
        from npuspec.cli.errors import UsageError
        raise UsageError(f"{args.port} must be in [0, 65535]", "--port")
    sock = _bind(args.host, args.port)  # before the model loads: a taken port fails at once
    names = args.served_model_name or [args.model]
    host, port = sock.getsockname()[:2]
    # the address first (with --port 0 the caller learns the port); /health answers 200 once
    # the model is loaded and warmed up
    print(f"npuspec serve: {names[0]} on http://{host}:{port}", flush=True)
    import torch
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
    from npuspec.cli.errors import UsageError
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
