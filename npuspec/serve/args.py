"""The server's flags (`vllm serve`'s names) and what they build: `add_arguments` for the
parser, `llm_kwargs` (the checks that need no model, run in the HTTP process before the engine
process starts) and `build_llm` (the engine, in the engine process, npuspec.serve.core). Only
the last two import the engine and the models (torch), when called: building the flags does not,
so `npuspec serve --help` and its flag errors stay fast."""
from __future__ import annotations

import argparse
import json

from npuspec.cli_util.errors import UsageError, with_field
from npuspec.cli_util.flags import add_quantization_flag, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    add_quantization_flag(p)
    p.add_argument("--seed", type=int, default=0, help="seed of requests that send none")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads")
    p.add_argument("--stream-interval", type=positive, default=1, metavar="N",
                   help="send streamed tokens every N engine steps (first tokens and ends at "
                        "once): smoother streams at 1, more throughput above it")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level")



JSON_FLAGS = {"compilation_config": "--compilation-config",
              "additional_config": "--additional-config",
              "kv_transfer_config": "--kv-transfer-config"}


def check_flags(args) -> None:
    """The checks that need neither torch nor the model, run before either is imported: a
    mistyped port or JSON flag fails in a fraction of a second, naming the flag."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"{args.port} must be in [0, 65535]", "--port")
    for key, flag in JSON_FLAGS.items():
        _json_flag(getattr(args, key), flag)


def _json_flag(value, flag: str):
    if value is None:
        return None
    try:
        d = json.loads(value)
    except json.JSONDecodeError as e:
        raise UsageError(f"not valid JSON ({e.msg} at column {e.colno} of {value!r})", flag) from None
    if not isinstance(d, dict):
        raise UsageError(f"must be a JSON object, got {type(d).__name__} {d!r}", flag)
    return d


def llm_kwargs(args) -> dict:
    """`LLM(**llm_kwargs(args))`, with every flag that needs no model checked (each error
    names its flag). The HTTP process runs it before it starts the engine process."""
    common, engine = _engine_side()
    cfg = common.spec_config(args.speculative_config)
    mdir = common.model_dir(args.model)
    common.check_draft(mdir, cfg)
    kw = {k: _json_flag(getattr(args, k), f) for k, f in JSON_FLAGS.items()}
    return dict(model=mdir, speculative_config=cfg.to_dict() if cfg else None,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs or engine.DEFAULT_MAX_NUM_SEQS,
                max_num_batched_tokens=args.max_num_batched_tokens,
                tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                dtype=args.dtype, quantization=args.quantization, seed=args.seed, **kw)


def check_engine_config(args) -> None:
    """`llm_kwargs(args)`, then every check `LLM(...)` makes before it loads weights (it reads
    config.json only: model, TP divisibility, lowering, KV pool against free memory), each
    error naming its flag. The HTTP process runs it so a bad start-up config fails before the
    engine process is spawned."""
    from npuspec.engine.config import create_engine_config  # heavy: see _engine_side
    kw = llm_kwargs(args)  # raises naming its flag already
    try:
        create_engine_config(**kw)
    except ValueError as e:
        raise _flag_error(e) from None


def build_llm(args):
    """The engine (in the engine process, npuspec.serve.core)."""
    common, engine = _engine_side()
    kw = llm_kwargs(args)
    common.set_threads(args.threads, kw["model"])
    try:
        return engine.LLM(**kw)
    except ValueError as e:  # name the flag: "LLM: max_model_len=..." -> "--max-model-len: ..."
        raise _flag_error(e) from None


def _flag_error(e: ValueError):
    msg = str(e)
    for key in ("speculative_config", "additional_config", "compilation_config", "kv_transfer_config",
                "max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                "dtype", "seed"):
        if key in msg:
            return with_field(e, "--" + key.replace("_", "-"))
    return e


def _engine_side():
    """The model checks (cli_util.common) and the engine package, for llm_kwargs and build_llm."""
    # heavy: keeps `--help` and flag errors off torch's import
    from npuspec import engine
    from npuspec.cli_util import common
    return common, engine
