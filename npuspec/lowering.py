"""Turn a Dynamo FX graph into a callable: run npuspec's verify passes, then lower.

Lowerings (options["lowering"]):
- "inductor": torch._inductor.compile_fx (C++ on CPU, Triton on CUDA). The verify passes run
  inside Inductor as its `joint_custom_pre_pass` (`npuspec.passes.InductorVerifyPass`), on the
  ATen graph AOT autograd produced, so Inductor's FX graph cache keys include the passes'
  uuid(). `fallback_random=True` keeps torch.rand/exponential_/multinomial the eager ops, so a
  compiled step draws the same numbers as eager from the same RNG state.
- "eager": AOT autograd traces the Dynamo graph to ATen (no decompositions), the passes run on
  it, and the rewritten graph runs op by op.
- "torchair": the passes run on the ATen graph as for "eager", then torch_npu's torchair NPU
  backend lowers it (Ascend only; imported only there). With a cache directory, GE's graph
  compile cache is pointed at the cache entry (npuspec/graphs/cache/torchair.py).

Why ATen and not the Dynamo graph: Dynamo keeps every user spelling (`x == y`, `torch.eq`,
`x.cumprod(1)`, `torch.cumprod(x, dim=-1)`, methods vs functions); AOT tracing normalises them to
one ATen op each, so one traced pattern per idiom covers them all.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("npuspec.backend")


def inductor_config_patches(opts: Any) -> dict:
    """Inductor config for the npuspec lowering (also what the pass benchmark uses)."""
    from npuspec.passes import InductorVerifyPass

    patches = {}
    if getattr(opts, "mode", None):
        patches.update(torch._inductor.list_mode_options(opts.mode))
    patches["joint_custom_pre_pass"] = InductorVerifyPass()
    patches["fallback_random"] = True
    return patches


def lower_inductor(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=inductor_config_patches(opts))


def _aot_with_passes(gm: torch.fx.GraphModule, example_inputs: list, inner: Callable) -> Callable:
    """AOT-trace to ATen (no decompositions), run the verify passes, then `inner(fw, inputs)`."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from npuspec.passes import run_passes

    def fw_compiler(fw: torch.fx.GraphModule, fw_inputs: list):
        run_passes(fw, flavor="aten")
        return inner(fw, fw_inputs)

    return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, decompositions={})


def lower_eager(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    from functorch.compile import make_boxed_func

    return _aot_with_passes(gm, example_inputs, lambda fw, _: make_boxed_func(fw.forward))


def lower_torchair(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    # Only reachable on npu (BackendOptions refuses torchair elsewhere). Never run on an NPU
    # here: tests/cache uses a fake torchair.
    from functorch.compile import make_boxed_func
    from torch_npu.dynamo import torchair  # noqa: F401

    from npuspec.graphs.cache.torchair import compiler_config

    # Inside the graph cache (npuspec.graphs.cache) the config also points GE's compile cache
    # at the entry's private directory, under the npuspec key; otherwise torchair's default.
    npu_backend = torchair.get_npu_backend(compiler_config=compiler_config(torchair))
    return _aot_with_passes(gm, example_inputs,
                            lambda fw, ins: make_boxed_func(npu_backend(fw, ins)))


LOWERINGS = {"inductor": lower_inductor, "eager": lower_eager, "torchair": lower_torchair}


def lower(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    fn = LOWERINGS[opts.lowering](gm, example_inputs, opts)
    log.info("npuspec: lowered with %s", opts.lowering)
    return fn
