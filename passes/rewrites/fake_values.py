"""Fake values for the nodes the passes insert, from the ops' meta kernels where that is the
mode's own value (`fake_value`). Kept apart from nodes.py, which imports it, as a helper of the
rules and of the passes above them."""
from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.utils._pytree import tree_leaves, tree_map_only

aten = torch.ops.aten


def _static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def fake_value(target, args, kwargs=None):
    """target(*args, **kwargs) on fake values (their own mode dispatches it), by its meta
    kernel where `_from_meta_kernel` takes it."""
    kwargs = kwargs or {}
    fast = _from_meta_kernel(target, args, kwargs)
    return fast if fast is not None else target(*args, **kwargs)


# Every node a pass inserts, and every op a replacement trace records, needs its fake value.
# Through FakeTensorMode's dispatch that costs 0.4-0.8 ms an op on a 2-core EPYC (the mode's
# checks, a FakeTensor made through the dispatcher; an npuspec op also passes custom_op's
# wrappers twice): ~30 % of the passes' time on vLLM v1's step. For the ops below, functional,
# unseeded, with output sizes that follow from the input sizes, the same value comes from the op
# run as the fake mode itself runs it (its meta kernel, the mode off, the inputs seen as meta
# tensors) with the output wrapped as the mode's own (`from_meta_and_device`): a view still
# shares its base's storage. 120-530 us an op. tests/passes/test_fake_value.py compares each
# with the mode's dispatch (sizes, strides, dtype, device, storage).
_META_OPS = frozenset({
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor,
    aten.select.int, aten.expand.default, aten.view.default, aten.permute.default,
    aten.gather.default, aten.sum.dim_IntList, aten.sum.default, aten.cumprod.default,
    aten.cumsum.default, aten.argmax.default, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor,
    aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar,
    aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.bitwise_not.default,
    aten.logical_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.where.self, aten.masked_fill.Scalar, aten.clamp_min.default, aten.add.Tensor,
    aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
    torch.ops.prims.convert_element_type.default,
})
# npuspec's verify ops, by name (this module is imported before the kernels register them):
# their fake implementations only allocate their outputs
_VERIFY_OPS = frozenset(f"npuspec::{n}" for n in (
    "greedy_accept", "ratio_accept", "residual_probs", "residual_sample", "rejection_sample"))


def _meta_op(target) -> bool:
    return target in _META_OPS or (isinstance(target, torch._ops.OpOverload)
                                   and target._overloadname == "default"
                                   and target.name() in _VERIFY_OPS)


def _from_meta_kernel(target, args, kwargs) -> Optional[object]:
    """target's fake value by its meta kernel, or None where the mode's dispatch must run:
    another op; no tensor; a tensor that is not one mode's FakeTensor on one device, with
    static sizes and strides and no constant; a symbolic scalar."""
    if not _meta_op(target):
        return None
    leaves = tree_leaves((args, kwargs))
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    if not tensors or not isinstance(tensors[0], FakeTensor):
        return None
    mode, device = tensors[0].fake_mode, tensors[0].device
    for t in tensors:
        if (not isinstance(t, FakeTensor) or t.fake_mode is not mode or t.device != device
                or t.constant is not None or not _static(t.shape) or not _static(t.stride())):
            return None
    if any(isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) for a in leaves):
        return None
    with in_kernel_invocation_manager(mode):
        dtype = _pointwise_dtype(target, args, kwargs, tensors)
        out = (torch.empty(torch.broadcast_shapes(*(t.shape for t in tensors)), dtype=dtype,
                           device="meta") if dtype is not None else target(*args, **kwargs))
    return tree_map_only(torch.Tensor, lambda t: mode.fake_tensor_converter.from_meta_and_device(
        mode, t, device), out)


# Pointwise ops on inputs each laid out contiguously in its own shape: the output is a
# contiguous tensor of their broadcast shape, of the dtype below (what TensorIterator gives:
# where every operand's strides fall from left to right, its dims keep their order; the meta
# kernels are Python references, 0.3-1 ms an op here against ~5 us for an empty meta tensor).
_TO_BOOL = frozenset({
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
    aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
    aten.ge.Tensor, aten.ge.Scalar, aten.logical_not.default})
_PROMOTED = frozenset({  # the dtype of torch.result_type of the two operands
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.add.Tensor, aten.sub.Tensor,
    aten.mul.Tensor, aten.div.Tensor, aten.clamp_min.default})
_SCANS = frozenset({aten.cumprod.default, aten.cumsum.default})


def _pointwise_dtype(target, args, kwargs, tensors) -> Optional[torch.dtype]:
    """The output dtype where the shortcut above holds (called with the mode off), else
    None: another op, keyword arguments, or an input laid out otherwise (strided, expanded,
    an offset slice)."""
    if kwargs or not (target in _TO_BOOL or target in _PROMOTED or target in _SCANS
                      or target in _OWN_DTYPE):
        return None
    if any(t.stride() != _contiguous(t.shape) for t in tensors):
        return None
    if target in _TO_BOOL:
        return torch.bool
    if target in _SCANS:
        x = args[0]
        return x.dtype if x.is_floating_point() or x.is_complex() else torch.int64
    if target in _OWN_DTYPE:
        return _OWN_DTYPE[target](args)
    dtype = torch.result_type(*args[:2])
    if target is aten.div.Tensor and not (dtype.is_floating_point or dtype.is_complex):
        return torch.get_default_dtype()
    return dtype


_OWN_DTYPE = {
    aten.bitwise_not.default: lambda a: a[0].dtype,
    aten.masked_fill.Scalar: lambda a: a[0].dtype if _fills_in_place(a) else None,
    aten.where.self: lambda a: torch.result_type(a[1], a[2]),
    torch.ops.prims.convert_element_type.default: lambda a: a[1],
}


def _fills_in_place(a) -> bool:
    """The mask broadcasts to the filled tensor's own shape (else the meta kernel raises)."""
    try:
        return torch.broadcast_shapes(a[0].shape, a[1].shape) == a[0].shape
    except RuntimeError:
        return False


def _contiguous(shape) -> tuple:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))
