"""npuspec: speculative decoding as a torch.compile backend plus a small eager runtime."""
from npuspec._counters import counters

__version__ = "0.1.0"

__all__ = ["SpeculativeConfig", "counters", "LLM", "SamplingParams", "compile", "__version__"]

_LAZY = {
    "SpeculativeConfig": "npuspec.config",
    "LLM": "npuspec.engine",
    "SamplingParams": "npuspec.engine",
    "compile": "npuspec.compilation.api",
}


def __getattr__(name):
    # Submodules pull in torch, models and the runtime; import them only when asked for.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'npuspec' has no attribute {name!r}")
