"""Compact Llama / Qwen2 / Qwen3 decoder over a paged KV pool (laid out by the engine, or as
fixed request slots by `allocate_cache`), HF checkpoint loading (HF safetensors directories
and llama.cpp GGUF files), the embedded tiny model (`load_model("tiny")`), and the drafter
modules and their checkpoints (draft_config.py, draft_loading.py). See docs/models.md. It
imports only npuspec.kernels and npuspec.models itself (docs/design.md, "The shape")."""
from npuspec.models.config import ModelConfig, SUPPORTED_MODEL_TYPES
from npuspec.models.decoder import AttnMetadata, DecoderLM, KVCache, PagedKVCache
from npuspec.models.loading import (TINY_MODEL_DIR, load_model, load_tokenizer, read_model_config,
                                    resolve_model_dir, save_model)

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES", "DecoderLM", "KVCache", "PagedKVCache", "AttnMetadata",
           "TINY_MODEL_DIR",
           "load_model", "load_tokenizer", "read_model_config", "resolve_model_dir", "save_model"]
