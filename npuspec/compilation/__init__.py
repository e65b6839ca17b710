"""npuspec.compilation: the compile side in one place (docs/design.md), as vLLM's
vllm/compilation/ is. One file per concern, each importing only files below it:

    backend.py       the `npuspec` torch.compile backend: options, checks, then the steps below
    graph_breaks.py  a graph Dynamo ended at a break, named once with its line
    cache.py         the graph cache's load-or-compile entry point and the call's JSON artifacts
    cache_keys.py    the cache key: what makes two compilations interchangeable
    lowering.py      the lowering choice (inductor / eager / torchair) and the small-M linear pass
    pass_counts.py   pass counters recorded beside Inductor's cache, replayed on a hit
    graph_text.py    a graph's node lines, what both keys hash (its code is costly to generate)
    compiled.py      CompiledBySignature: the engine's steps compiled once per input signature

Layers, lowest first (an import only ever points down):
    npuspec.{envs, _counters, platform, config}
    npuspec.kernels    the npuspec:: ops
    npuspec.passes     the FX passes that rewrite verify steps into those ops
    npuspec.graphs     graph capture and replay; npuspec.graphs.cache: the cache's on-disk store
    npuspec.compilation

The package imports nothing itself: `import npuspec` stays cheap, and torch finds the backend
through setup.cfg's `torch_dynamo_backends` entry point (npuspec.compilation.backend).
"""
