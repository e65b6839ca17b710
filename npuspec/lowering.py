"""Turn a Dynamo FX graph into a callable: run npuspec's verify passes, then lower.

Lowerings (options["lowering"]):
- "inductor": torch._inductor.compile_fx (C++ on CPU, Triton on CUDA).
- "eager": run the (rewritten) FX graph as is.
- "torchair": torch_npu's torchair NPU backend (Ascend only; imported only there).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("npuspec.backend")


def lower_inductor(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    patches = {}
    if opts.mode:
        patches.update(torch._inductor.list_mode_options(opts.mode))
    return compile_fx(gm, example_inputs, config_patches=patches)


def lower_eager(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    return gm.forward


def lower_torchair(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    # Only reachable on npu (BackendOptions refuses torchair elsewhere).
    from torch_npu.dynamo import torchair  # noqa: F401

    config = torchair.CompilerConfig()
    return torchair.get_npu_backend(compiler_config=config)(gm, example_inputs)


LOWERINGS = {"inductor": lower_inductor, "eager": lower_eager, "torchair": lower_torchair}


def lower(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    fn = LOWERINGS[opts.lowering](gm, example_inputs, opts)
    log.info("npuspec: lowered with %s", opts.lowering)
    return fn
