"""Compact Llama / Qwen2 / Qwen3 decoder with a static slot-indexed KV cache, HF checkpoint
loading (HF safetensors directories and llama.cpp GGUF files), and the embedded tiny model
(`load_model("tiny")`). See docs/models.md."""
from npuspec.models.config import ModelConfig, SUPPORTED_MODEL_TYPES
from npuspec.models.decoder import AttnMetadata, DecoderLM, KVCache, PagedKVCache
from npuspec.models.loading import (TINY_MODEL_DIR, load_model, load_tokenizer, read_model_config,
                                    resolve_model_dir, save_model)

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES", "DecoderLM", "KVCache", "PagedKVCache", "AttnMetadata",
           "TINY_MODEL_DIR",
           "load_model", "load_tokenizer", "read_model_config", "resolve_model_dir", "save_model"]
