"""Pack a CPU model's projections once at load for `npuspec::linear_packed`.

The decode/verify step is bound by reading the weights; the packed layout
(kernels/linear_packed_cpu.py) lets a few-row step read each weight once at the memory's
streaming speed, whatever the row count up to ~8. Packing is for inference: the packed
tensors are buffers, not parameters, and the row-major weights they replace are dropped (a
tied embedding is looked up in the packed LM head, so nothing is held twice). The norms then
run as `npuspec::add_rms_norm` (kernels/rms_norm_cpu.py), so every layer compiles to the
same few kernels.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from npuspec import envs
from npuspec.kernels import linear_packed_cpu as lp
from npuspec.models import arena
from npuspec.models.eagle import MLP, Attention

log = logging.getLogger(__name__)


def can_pack(model: nn.Module) -> bool:
    """CPU weights in a dtype the kernel reads, and a C++ compiler. The kernel's build is not
    awaited (it runs in the background, `prebuild_cpu_kernels`); should it fail, the op logs
    once and runs its PyTorch reference on the packed weights."""
    w = model.norm.weight
    return w.device.type == "cpu" and w.dtype in lp.WEIGHT_DTYPES and lp.can_pack()


def _pack_linear(layer: nn.Linear) -> None:
    wp = lp.pack_weight(layer.weight.detach())
    del layer.weight  # drops the parameter; the decoder reads `packed`
    layer.register_parameter("weight", None)
    layer.register_buffer("packed", wp, persistent=False)


def pack_model(model: nn.Module) -> bool:
    """Pack every projection and the LM head of a `DecoderLM` in place (idempotent).
    Returns whether the model is packed; when the kernel cannot run here it logs once and
    leaves the model as it was (torch.mm reads the row-major weights). The packed weights then
    move into one huge-page arena in step order (npuspec/models/arena.py; NPUSPEC_CPU_HUGEPAGES)."""
    if getattr(model, "head_packed", None) is not None or getattr(model, "head_quant", None) is not None:
        if getattr(model, "head_quant", None) is not None:
            model.fused_norm = lp.can_pack()
        _place(model)
        return True
    if not can_pack(model):
        if model.norm.weight.device.type == "cpu":
            log.warning("npuspec: weights not packed (dtype %s or no C++ toolchain); the step "
                        "uses torch.mm", model.norm.weight.dtype)
        return False
    with torch.no_grad():
        for block in model.layers:
            for layer in (block.wqkv, block.wo, block.w13, block.w2):
                _pack_linear(layer)
        if model.lm_head is None:  # tied: the embedding is looked up in the packed head
            model.head_packed = lp.pack_weight(model.embed.weight.detach())
            model.embed = None
        else:
            model.head_packed = lp.pack_weight(model.lm_head.weight.detach())
            model.lm_head = None
    model.fused_norm = lp.can_pack()  # same toolchain; the op falls back the same way
    _place(model)
    return True


def _place(model: nn.Module) -> None:
    if envs.cpu_hugepages() and model.norm.weight.device.type == "cpu":
        arena.place_weights(model)


def _pack_fused(owner: nn.Module, names: tuple, attr: str) -> None:
    """Pack the concatenation of owner's projections `names` (same input) as one weight
    `owner.<attr>_packed` (+ `<attr>_bias`): one kernel call instead of len(names)."""
    layers = [getattr(owner, n) for n in names]
    w = torch.cat([layer.weight.detach() for layer in layers])
    b = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
    owner.register_buffer(f"{attr}_packed", lp.pack_weight(w), persistent=False)
    owner.register_buffer(f"{attr}_bias", b, persistent=False)
    for layer in layers:
        del layer.weight
        layer.register_parameter("weight", None)


def pack_draft(module: nn.Module) -> bool:
    """Pack a drafter (npuspec.models.eagle / mtp / medusa) for inference, as pack_model does a
    target: q|k|v and gate|up fused into one packed weight each, every other projection packed.
    Returns whether it is packed (a CPU model in a kernel dtype with a C++ toolchain)."""
    w = next(module.parameters())
    if not (w.device.type == "cpu" and w.dtype in lp.WEIGHT_DTYPES and lp.can_pack()):
        return False
    with torch.no_grad():
        for m in list(module.modules()):
            if isinstance(m, Attention):
                _pack_fused(m, ("q_proj", "k_proj", "v_proj"), "qkv")
            elif isinstance(m, MLP):
                _pack_fused(m, ("gate_proj", "up_proj"), "gate_up")
        for m in list(module.modules()):
            if isinstance(m, nn.Linear) and m.weight is not None:
                _pack_linear(m)
    return True
