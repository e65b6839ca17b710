"""`EngineConfig`: every `LLM(...)` argument parsed and checked once, before any work, and handed
down as one object (vLLM's VllmConfig, nano-vllm's Config). `ParallelConfig` is the tensor-
parallel part; a spawned worker gets its rank through it."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from npuspec import envs
from npuspec.config import SpeculativeConfig
from npuspec.engine import args
from npuspec.models import read_model_config
from npuspec.models.config import ModelConfig
from npuspec.models.tp import check_shardable, local_config
from npuspec.platform import parse_device
from npuspec.spec_decode.extract_config import (KVTransferConfig, check_with_spec,
                                                parse_kv_transfer_config)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    world: int = 1                  # tensor_parallel_size
    launcher: str = "mp"            # "mp" (rank 0 spawns the workers) | "external_launcher"
    drafts_sharded: bool = False    # the drafter runs on every rank with its shard
    # set in a worker rank 0 spawned: (rank, init_method of the group's rendezvous)
    worker: Optional[tuple[int, str]] = None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str                      # checkpoint directory, .gguf file or "tiny"
    model_config: ModelConfig       # config.json, this rank's share of the heads
    spec: Optional[SpeculativeConfig]
    kv_transfer: Optional[KVTransferConfig]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int     # prefill tokens per iteration (+ the decode step's)
    block_size: int
    num_blocks: int                 # the paged KV pool, the scratch block included
    capture: bool                   # replay captured graphs (False: eager or compiled only)
    capture_sizes: Optional[list]   # compilation_config.cudagraph_capture_sizes
    lowering: Optional[str]         # "inductor" | "eager" | None: the backend's default
    enforce_eager: bool
    dtype: torch.dtype
    device: torch.device
    seed: int
    parallel: ParallelConfig
    quantization: Optional[str] = None  # npuspec.models.quant.QUANTIZATIONS

    @property
    def k_max(self) -> int:
        return self.spec.num_speculative_tokens if self.spec else 0

    @property
    def cache_len(self) -> int:
        """Positions a sequence may write: draft positions run K past max_model_len."""
        return self.max_model_len + self.k_max + 1


def create_engine_config(model: Any = "tiny", speculative_config: Any = None,
                         max_model_len: Any = None,
                         max_num_seqs: Any = args.DEFAULT_MAX_NUM_SEQS,
                         enforce_eager: Any = False, compilation_config: Any = None,
                         additional_config: Any = None, tensor_parallel_size: Any = 1,
                         seed: Any = 0, dtype: Any = "auto", device: Any = None,
                         block_size: Any = None, num_kv_blocks: Any = None,
                         max_num_batched_tokens: Any = None, kv_transfer_config: Any = None,
                         distributed_executor_backend: Any = None, quantization: Any = None,
                         worker: Optional[tuple[int, str]] = None) -> EngineConfig:
    """`LLM(...)`'s arguments -> EngineConfig; a bad value raises naming it and the fix.
    Reads config.json only: the KV pool is sized (and checked against free memory) before
    any weights load."""
    envs.check_all()  # bad NPUSPEC_* values first, so they fail here rather than in a compile
    world, launcher = args.parse_tp(tensor_parallel_size, distributed_executor_backend,
                                    spawned=worker is not None)
    max_num_seqs = args.pos_int("max_num_seqs", max_num_seqs)
    if not isinstance(enforce_eager, bool):
        raise args.arg_error("enforce_eager", enforce_eager, "must be True or False")
    args.parse_seed(seed)
    spec = args.parse_spec(speculative_config, additional_config, tensor_parallel_size)
    kv = parse_kv_transfer_config(kv_transfer_config)
    check_with_spec(kv, spec.method if spec else None)
    capture, sizes, lowering = args.parse_compilation(compilation_config, enforce_eager)
    dev = parse_device(device)
    torch_dtype = args.parse_dtype(dtype)
    model = args.parse_model(model)
    quantization = args.parse_quantization(quantization, model, world, dev, torch_dtype)
    mcfg = read_model_config(model)
    drafts_sharded = False
    if world > 1:
        check_shardable(mcfg, world)
        drafts_sharded = args.parse_draft_tp(spec, world)
        mcfg = local_config(mcfg, world)  # this rank's share of the KV pool
    max_model_len = args.parse_max_model_len(max_model_len, mcfg)
    k_max = spec.num_speculative_tokens if spec else 0
    bs, num_blocks = args.parse_kv_pool(block_size, num_kv_blocks, max_num_seqs, max_model_len,
                                        k_max, dev.type)
    batched = args.parse_batched_tokens(max_num_batched_tokens, max_num_seqs, k_max)
    args.check_kv_memory(mcfg, spec, model, num_blocks=num_blocks, block_size=bs,
                         max_num_seqs=max_num_seqs, max_model_len=max_model_len, k_max=k_max,
                         dtype=torch_dtype, device=dev, num_kv_blocks=num_kv_blocks)
    return EngineConfig(model, mcfg, spec, kv, max_model_len, max_num_seqs, batched, bs,
                        num_blocks, capture, sizes, lowering, enforce_eager, torch_dtype, dev,
                        seed, ParallelConfig(world, launcher, drafts_sharded, worker), quantization)
