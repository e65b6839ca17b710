"""`LLM(...)` argument checks: each bad value raises a ValueError naming it and the fix."""
from __future__ import annotations

import difflib
import logging
import os
import sys
from typing import Any, Optional

import torch

from npuspec import envs
from npuspec import platform as platforms  # looked up per call: tests patch free_memory
from npuspec.config import (ADDITIONAL_KEYS, DynamicSpecConfig, SpeculativeConfig,
                            merge_additional_config)
from npuspec.engine.block_manager import seat_blocks
from npuspec.engine.sampling import ArgTypeError, a_type
from npuspec.methods import METHODS
from npuspec.models.config import read_config_json
from npuspec.models.decoder import slot_cache_rows
from npuspec.models.gguf import find_gguf
from npuspec.models.loading import read_model_config
from npuspec.models.quant import QUANTIZATIONS
from npuspec.spec_decode.heads import SHIPPED_DRAFTS, head_path, resolve_draft

log = logging.getLogger("npuspec.engine")

ENGINE_METHODS = tuple(METHODS)  # every method of the registry runs in the engine
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
COMPILATION_KEYS = ("cudagraph_capture_sizes", "cudagraph_mode", "backend")
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
DEFAULT_MAX_NUM_SEQS = 16
LAUNCHERS = ("mp", "external_launcher")  # distributed_executor_backend
DEFAULT_MAX_MODEL_LEN = 2048


def arg_error(key: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"LLM: {key}={value!r}: {fix}")


def pos_int(key: str, v: Any, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise arg_error(key, v, f"must be an integer >= {lo}")
    return v


def parse_seed(seed: Any) -> int:
    # it seeds numpy's generator (the unseeded requests' seeds), which takes any int >= 0
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise arg_error("seed", seed, "must be an integer >= 0")
    return seed


def parse_model(model: Any) -> str:
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if model is None:
        return "tiny"
    if not isinstance(model, str) or not model:
        raise ArgTypeError(f"LLM: model={model!r}: must be a path (an HF checkpoint directory "
                           f"or a .gguf file) or 'tiny' for the embedded model")
    return model


def parse_tp(tp: Any, backend: Any, spawned: bool = False) -> tuple[int, str]:
    """-> (tensor_parallel_size, launcher: "mp" | "external_launcher"); docs/distributed.md.
    `spawned`: a worker rank 0 started, which checked all this."""
    pos_int("tensor_parallel_size", tp)
    if backend is not None and backend not in LAUNCHERS:
        raise arg_error("distributed_executor_backend", backend,
                        f"use one of {', '.join(map(repr, LAUNCHERS))} (or None: 'mp', or "
                        f"'external_launcher' under torchrun)")
    launched = envs.torchrun_rank()
    if spawned:
        return tp, "mp"
    if launched is not None and launched[1] > 1:
        rank, world, _ = launched
        if backend == "mp":
            raise arg_error("distributed_executor_backend", backend,
                            f"this process is rank {rank} of {world} started by torchrun "
                            f"(WORLD_SIZE={world}); use 'external_launcher' (or None), or run "
                            f"without torchrun to let 'mp' spawn the workers")
        if tp != world:
            raise arg_error("tensor_parallel_size", tp,
                            f"torchrun started WORLD_SIZE={world} processes; every one runs a "
                            f"rank of one engine, so set tensor_parallel_size={world} (or "
                            f"start torchrun with --nproc-per-node={tp})")
        return tp, "external_launcher"
    if backend == "external_launcher":
        raise arg_error("distributed_executor_backend", backend,
                        "needs a launcher: start the script with torchrun --nproc-per-node=N "
                        "(it sets RANK and WORLD_SIZE), or use 'mp'")
    return tp, "mp"


def parse_draft_tp(spec, world: int) -> bool:
    """Whether the drafter is sharded over the `world` target ranks, every rank running it
    (True), or runs whole on rank 0 beside the target's shard (False).
    `draft_tensor_parallel_size` (1 or N, checked by SpeculativeConfig) defaults to N for
    model drafters, as in vLLM; host proposers (ngram, suffix) and extract_hidden_states run
    on rank 0 whatever it says."""
    if spec is None or METHODS[spec.method].host_only:
        return False
    dtp = spec.draft_tensor_parallel_size
    return (world if dtp is None else dtp) == world


def parse_max_model_len(v: Any, cfg) -> int:
    if v is None:
        return min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    pos_int("max_model_len", v, lo=2)
    if v > cfg.max_position_embeddings:
        raise arg_error("max_model_len", v, f"exceeds the model's max_position_embeddings "
                                            f"({cfg.max_position_embeddings}); use a value <= that")
    return v


def parse_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():  # the weights and the KV cache hold this type
            raise arg_error("dtype", dtype, f"use one of {', '.join(DTYPES)} or 'auto'")
        return dtype
    if dtype in (None, "auto"):
        return torch.float32
    if dtype not in DTYPES:
        raise arg_error("dtype", dtype, f"use one of {', '.join(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def parse_quantization(v: Any, model: str, world: int, dev: torch.device,
                       dtype: torch.dtype) -> Optional[str]:
    """LLM(quantization=...): None (weights in `dtype`), "gguf" (a GGUF file's Q8_0/Q4_0/
    Q4_1/Q4_K weights as stored) or "int8"/"int4" (weight-only, quantized at load)."""
    if v is None:
        return None
    if v not in QUANTIZATIONS:
        raise arg_error("quantization", v, f"use None, {', '.join(repr(q) for q in QUANTIZATIONS)}")
    if v == "gguf" and find_gguf(model) is None:
        raise arg_error("quantization", v, f"{model} is not a GGUF file; use 'int8' or 'int4' to "
                                           "quantize a checkpoint at load")
    if world > 1:
        raise arg_error("quantization", v, "is not supported with tensor_parallel_size > 1 yet; "
                                           "use quantization=None or tensor_parallel_size=1")
    if dev.type not in ("cpu", "npu"):
        raise arg_error("quantization", v, f"runs on CPU (npuspec's kernel) and NPU (CANN's "
                                           f"weight-quant matmul), not on {dev.type}; use "
                                           "device='cpu' or quantization=None")
    if dev.type == "npu" and dtype not in (torch.float16, torch.bfloat16):
        raise arg_error("quantization", v, f"on the NPU takes float16 or bfloat16 activations "
                                           f"(dtype is {dtype}); pass dtype='bfloat16'")
    return v


def _default_lowering() -> Optional[str]:
    # The knob is `npuspec.engine.DEFAULT_LOWERING` (tests set it with monkeypatch), so it is
    # read on the package at call time rather than copied into this module. The package is
    # always loaded (this module is in it); reading it from sys.modules keeps the package's
    # __init__, which imports this module, out of this module's imports.
    return getattr(sys.modules["npuspec.engine"], "DEFAULT_LOWERING")


def parse_compilation(cc: Any, enforce_eager: bool) -> tuple[Any, Optional[list], Optional[str]]:
    """-> (capture: True | False, capture sizes in tokens or None, lowering or None)."""
    if cc is None:
        cc = {}
    if not isinstance(cc, dict):
        raise arg_error("compilation_config", cc, "must be a dict such as "
                        "{'cudagraph_capture_sizes': [4, 8, 16], 'cudagraph_mode': 'FULL'}")
    for k in cc:
        if k not in COMPILATION_KEYS:
            near = difflib.get_close_matches(str(k), COMPILATION_KEYS, n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(COMPILATION_KEYS)}"
            raise ValueError(f"LLM: compilation_config has unknown key {k!r}; {hint}")
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not sizes or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise arg_error("compilation_config.cudagraph_capture_sizes", sizes,
                            "must be a non-empty list of positive token counts, e.g. [4, 8, 16]")
        sizes = sorted(set(sizes))
    mode = cc.get("cudagraph_mode", "FULL_DECODE_ONLY")
    if isinstance(mode, str):
        mode = mode.upper()
    if mode not in CUDAGRAPH_MODES:
        raise arg_error("compilation_config.cudagraph_mode", cc.get("cudagraph_mode"),
                        f"must be one of {', '.join(CUDAGRAPH_MODES)}")
    lowering = cc.get("backend", _default_lowering())
    if lowering is not None and lowering not in ("inductor", "eager"):
        raise arg_error("compilation_config.backend", lowering, "must be 'inductor' or 'eager'")
    if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        log.info("npuspec captures the whole decode step (FULL); cudagraph_mode=%s behaves "
                 "as FULL_DECODE_ONLY", mode)
    capture = not enforce_eager and mode != "NONE"
    return capture, sizes, lowering


def parse_spec(spec: Any, additional: Any, tp: int) -> Optional[SpeculativeConfig]:
    if spec is not None and not isinstance(spec, (dict, str, SpeculativeConfig)):
        raise ArgTypeError(
            f"LLM: speculative_config={spec!r} is {a_type(spec)}; pass a dict such as "
            f"{{'method': 'ngram', 'num_speculative_tokens': 4}}, its JSON string, or a "
            f"npuspec.SpeculativeConfig")
    if additional is not None and not isinstance(additional, dict):
        raise ArgTypeError(f"LLM: additional_config={additional!r} is "
                           f"{a_type(additional)}; pass a dict with keys among "
                           f"{', '.join(ADDITIONAL_KEYS)}, or None")
    if spec is None:
        if additional:
            for k in additional:
                if k not in ADDITIONAL_KEYS:
                    near = difflib.get_close_matches(str(k), ADDITIONAL_KEYS, n=1, cutoff=0.5)
                    hint = f"did you mean {near[0]!r}?" if near else \
                        f"valid keys: {', '.join(ADDITIONAL_KEYS)}"
                    raise ValueError(f"LLM: additional_config has unknown key {k!r}; {hint}")
            keys = [k for k in ("rejection_sampler_config", "dynamic_spec_config")
                    if k in additional]
            if keys:
                raise ValueError(f"LLM: additional_config.{keys[0]} needs a speculative_config; "
                                 f"pass speculative_config={{'method': ..., ...}} or drop it")
        return None
    d = merge_additional_config(spec, additional)
    cfg = SpeculativeConfig.from_dict(d, tensor_parallel_size=tp,
                                      device=platforms.current_platform().device)
    check_draft_path(cfg)
    return cfg


def check_draft_path(cfg: SpeculativeConfig) -> None:
    """The draft checkpoint named by speculative_config.model exists, checked before the
    target loads, with an error that says it is the draft's path (not the target's)."""
    if cfg.model in (None, "tiny") or not METHODS[cfg.method].needs_model:
        return  # "tiny": the embedded model (a draft for itself, in tests and demos)
    path = os.path.expanduser(resolve_draft(cfg.model))
    gguf_ok = cfg.method == "draft_model" and path.lower().endswith(".gguf")
    if os.path.isdir(path) or (gguf_ok and os.path.isfile(path)):
        return
    what = "a local HF checkpoint directory (config.json + *.safetensors) or a .gguf file" \
        if cfg.method == "draft_model" else \
        f"the head's checkpoint directory, or a shipped head ({', '.join(SHIPPED_DRAFTS)})"
    raise FileNotFoundError(
        f"speculative_config.model={cfg.model!r}: the draft model path "
        f"{'does not exist' if not os.path.exists(path) else 'is not a directory'}; "
        f"pass {what} for method {cfg.method!r}")


DEFAULT_BLOCK_SIZE = {"npu": 128}  # FIA's paged layout wants 128; elsewhere 16 (vLLM's)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # prefill tokens per iteration (+ the decode step's)


def parse_kv_pool(block_size: Optional[int], num_kv_blocks: Optional[int], max_num_seqs: int,
                  max_model_len: int, k_max: int, device_type: str) -> tuple[int, int]:
    """-> (block_size, num_blocks incl. the scratch block). The default pool holds every seat
    at max_model_len (plus the K draft positions of a verify step)."""
    bs = DEFAULT_BLOCK_SIZE.get(device_type, 16) if block_size is None else pos_int(
        "block_size", block_size)
    per_req = seat_blocks(max_model_len, k_max, bs)
    if num_kv_blocks is None:
        return bs, 1 + max_num_seqs * per_req
    pos_int("num_kv_blocks", num_kv_blocks, lo=2)
    if num_kv_blocks - 1 < per_req:
        raise arg_error("num_kv_blocks", num_kv_blocks,
                        f"the pool holds {num_kv_blocks - 1} blocks of {bs} tokens (block 0 is "
                        f"scratch), but one request at max_model_len={max_model_len} (+{k_max} "
                        f"draft positions) needs {per_req}; raise num_kv_blocks to at least "
                        f"{per_req + 1} or lower max_model_len")
    return bs, num_kv_blocks


def parse_batched_tokens(n: Optional[int], max_num_seqs: int, k_max: int) -> int:
    if n is None:
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs * (k_max + 1))
    return pos_int("max_num_batched_tokens", n)


def confidence_budget_config(spec: Optional[SpeculativeConfig]):
    """additional_config.dynamic_spec_config, or, for `enable_adaptive_verification: true`
    without one, the confidence budget at vLLM Ascend's defaults. (Upstream vLLM's adaptive
    verification also weighs the engine's load; npuspec's budget reads confidences only.)"""
    if spec is None:
        return None
    if spec.dynamic_spec_config is None and spec.enable_adaptive_verification:
        log.info("enable_adaptive_verification: verify lengths from the %s drafter's "
                 "confidences with the default budget (set additional_config."
                 "dynamic_spec_config to tune it)", spec.method)
        return DynamicSpecConfig(spec.method)
    return spec.dynamic_spec_config


# -- memory: the KV pools against what the device has free, before anything is allocated ------

def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def draft_kv_bytes(spec: Optional[SpeculativeConfig], target_cfg, target_path: str, *,
                   num_blocks: int, block_size: int, max_num_seqs: int, cache_len: int,
                   esize: int) -> int:
    """Bytes of the drafter's own K/V: a draft model's slot cache (a run of blocks per seat
    and the scratch block, models/decoder.py `allocate_cache`), or a hidden-state head's paged
    pool in the target pool's geometry. The head's layer count and head shape come from its
    config.json where given, else the target's; an unreadable config is its loader's to
    report, so it counts as none here."""
    if spec is None or not METHODS[spec.method].draft_kv:
        return 0  # ngram, suffix, medusa, extract_hidden_states keep no K/V
    if spec.method == "draft_model":
        try:
            d = read_model_config(spec.model)
        except (OSError, ValueError):
            return 0
        rows = slot_cache_rows(max_num_seqs, cache_len, block_size)
        return 2 * d.num_layers * rows * d.num_kv_heads * d.head_dim * esize
    try:
        d = read_config_json(head_path(spec, target_path), "")
    except (OSError, ValueError):
        return 0
    c, mtp = target_cfg, spec.method == "mtp"
    layers = d.get("num_nextn_predict_layers" if mtp else "num_hidden_layers")
    heads = None if mtp else d.get("num_key_value_heads")  # MTP layers are the target's shape
    dim = None if mtp else d.get("head_dim")
    layers, heads, dim = (x if isinstance(x, int) and x > 0 else dflt for x, dflt in
                          ((layers, 1), (heads, c.num_kv_heads), (dim, c.head_dim)))
    return 2 * layers * num_blocks * block_size * heads * dim * esize


def check_kv_memory(cfg, spec: Optional[SpeculativeConfig], model_path: str, *,
                    num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                    k_max: int, dtype: torch.dtype, device: torch.device,
                    num_kv_blocks: Optional[int]) -> int:
    """Raise a ValueError naming the bytes and the arguments to change when the KV pools
    cannot fit in the device's free memory (rather than a raw allocator error, or on Linux an
    out-of-memory kill when the pages are first touched). Returns the bytes needed."""
    esize = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * esize
    target = num_blocks * per_block
    draft = draft_kv_bytes(spec, cfg, model_path, num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=max_num_seqs, cache_len=max_model_len + k_max + 1,
                           esize=esize)
    free, source = platforms.free_memory(device)
    if target + draft <= free:
        return target + draft
    what = (f"{num_blocks} blocks x {block_size} tokens x {cfg.num_layers} layers x 2 (K, V) x "
            f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} dims x {esize} bytes ({dtype})")
    if draft:
        what += f", plus {_gib(draft)} for the {spec.method} drafter's K/V"
    fits = max(0, (num_blocks - 1) * free // (target + draft))  # blocks that fit, pro rata
    if num_kv_blocks is None:
        seats = fits // max(1, (num_blocks - 1) // max_num_seqs)
        fix = (f"lower max_num_seqs (={max_num_seqs}; about {seats} fit), max_model_len "
               f"(={max_model_len}) or block_size (={block_size}), or set num_kv_blocks to "
               f"size the pool directly")
    else:
        fix = (f"lower num_kv_blocks (={num_kv_blocks}; about {fits + 1} fit), block_size "
               f"(={block_size}) or max_num_seqs (={max_num_seqs})")
    raise ValueError(f"LLM: the KV cache needs {_gib(target + draft)} ({what}) but only "
                     f"{_gib(free)} is free on {device} ({source}); {fix}; or use a smaller "
                     f"dtype")
