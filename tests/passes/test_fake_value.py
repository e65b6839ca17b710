"""passes/rewrites/fake_values.py `fake_value`: an op the passes insert gets, from its meta kernel,
the fake value FakeTensorMode's dispatch gives it (sizes, strides, dtype, device, storage
offset, and a view sharing its base's storage), and anything else goes through the mode."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import npuspec.kernels  # noqa: F401  (the verify ops)
from npuspec.passes.rewrites import fake_values as fv

aten, prims, ns = torch.ops.aten, torch.ops.prims, torch.ops.npuspec
B, K, V = 3, 4, 11


def _inputs(mode):
    with mode:
        g = {"p": torch.empty(B, K, V), "q": torch.empty(B, K, V),
             "ids": torch.empty(B, K, dtype=torch.int64), "u": torch.empty(B, K),
             "ok": torch.empty(B, K, dtype=torch.bool), "ii": torch.empty(B, K, dtype=torch.int32),
             "e": torch.empty(B, V), "bonus": torch.empty(B, dtype=torch.int64)}
        g["pt"] = torch.empty(B, V, K).transpose(1, 2)             # [B, K, V], not contiguous
        g["ux"] = torch.empty(B, 1).expand(B, K)                   # a stride-0 dim
        g["us"] = torch.empty(B, K + 2)[:, 1:K + 1]                # an offset slice
    return g


# (op, args from the inputs by name or as literals); each op of _META_OPS at least once
CASES = [
    (aten.unsqueeze.default, ("ids", 2)), (aten.unsqueeze.default, ("us", 1)),
    (aten.squeeze.dim, ("ux", 1)), (aten.squeeze.dims, ("ux", [1])),
    (aten.slice.Tensor, ("p", 1, 0, 2)), (aten.slice.Tensor, ("us", 1, 1, 3)),
    (aten.select.int, ("p", 2, 0)), (aten.select.int, ("pt", 1, 1)),
    (aten.expand.default, ("bonus", [2, B])), (aten.view.default, ("p", [B * K, V])),
    (aten.permute.default, ("p", [2, 0, 1])), (aten.gather.default, ("p", 2, "ids3")),
    (aten.gather.default, ("pt", 2, "ids3")), (aten.sum.dim_IntList, ("ids", [1])),
    (aten.sum.dim_IntList, ("ok", [1], True)), (aten.sum.default, ("ii",)),
    (aten.cumprod.default, ("ok", 1)), (aten.cumprod.default, ("ii", 1)),
    (aten.cumsum.default, ("ux", 1)), (aten.argmax.default, ("pt", -1)),
    (aten.argmax.default, ("p", -1, True)),
    (aten.eq.Tensor, ("ids", "ii")), (aten.eq.Scalar, ("ids", -1)), (aten.ne.Tensor, ("u", "ux")),
    (aten.ne.Scalar, ("ids", 0)), (aten.lt.Tensor, ("u", "us")), (aten.lt.Scalar, ("u", 0.5)),
    (aten.le.Tensor, ("ux", "u")), (aten.le.Scalar, ("ii", 2)), (aten.gt.Tensor, ("us", "u")),
    (aten.gt.Scalar, ("p", 0.0)), (aten.ge.Tensor, ("u", "u")), (aten.ge.Scalar, ("pt", 0.1)),
    (aten.bitwise_not.default, ("ok",)), (aten.logical_not.default, ("ii",)),
    (aten.bitwise_and.Tensor, ("ok", "ok")), (aten.bitwise_or.Tensor, ("ii", "ids")),
    (aten.where.self, ("ok", "ids", "ii")), (aten.where.self, ("ok3", "p", "pt")),
    (aten.masked_fill.Scalar, ("pt", "ok3", float("-inf"))),
    (aten.clamp_min.default, ("pt", 0.0)), (aten.add.Tensor, ("ids", "ii")),
    (aten.add.Tensor, ("u", 1)), (aten.sub.Tensor, ("p", "pt")), (aten.mul.Tensor, ("ii", 0.5)),
    (aten.div.Tensor, ("ids", "ii")), (aten.div.Tensor, ("p", "e3")),
    (prims.convert_element_type.default, ("ok", torch.int64)),
    (prims.convert_element_type.default, ("pt", torch.float64)),
    # dtypes of the pointwise shortcut (one shape, contiguous): promotions with scalars,
    # integer division, bool and int scans
    (aten.add.Tensor, ("ids", 0.5)), (aten.clamp_min.default, ("ii", 0.5)),
    (aten.clamp_min.default, ("ii", 0)), (aten.mul.Tensor, ("ok", "ok")),
    (aten.mul.Tensor, ("ok", 3)), (aten.div.Tensor, ("ii", "ii")),
    (aten.sub.Tensor, ("ii", "ids")), (aten.where.self, ("ok", "ii", "u")),
    (aten.cumsum.default, ("ok", 1)), (aten.cumprod.default, ("u", 0)),
    (prims.convert_element_type.default, ("ii", torch.bool)), (aten.bitwise_not.default, ("ii",)),
    (aten.bitwise_and.Tensor, ("ok", "ii")), (aten.eq.Tensor, ("u", "ids")),
    (aten.masked_fill.Scalar, ("ii", "ok", -1)), (aten.ne.Scalar, ("ok", True)),
    # broadcast: each operand contiguous in its own shape (a lifted 0-dim value, a column
    # against a row, a [B, K, 1] mask over [B, K, V])
    (aten.where.self, ("ok3", "zero", "p")), (aten.where.self, ("ok3", "zero", "ok3f")),
    (aten.lt.Tensor, ("row", "col")), (aten.masked_fill.Scalar, ("p", "ok3", 0.0)),
    (aten.mul.Tensor, ("e3", "p")), (aten.add.Tensor, ("zero64", "u")),
    (aten.ge.Tensor, ("col", "zero64")), (aten.mul.Tensor, ("b1v", "k11")),
    (aten.where.self, ("ok3", "k11", "b1v")),
    (ns.greedy_accept.default, ("ids", "ids")),
    (ns.ratio_accept.default, ("p", "q", "ids", "u", "ge")),
    (ns.residual_probs.default, ("p", "q", "none")),
    (ns.residual_sample.default, ("p", "q", "p", "none", "race")),
    (ns.rejection_sample.default, ("p", "ids", "q", None, None, None, "u", "e", False, None,
                                   None, None, "bonus")),
]


def _args(spec, g, mode):
    with mode:
        g = {**g, "ids3": g["ids"].unsqueeze(2), "ok3": g["ok"].unsqueeze(2),
             "e3": g["e"].unsqueeze(1), "zero": torch.empty(()), "ok3f": torch.empty(B, K, 1),
             "zero64": torch.empty((), dtype=torch.float64),
             "row": torch.empty(K, dtype=torch.int64), "col": torch.empty(B, 1, dtype=torch.int64),
             "b1v": torch.empty(B, 1, V), "k11": torch.empty(1, K, 1, dtype=torch.float64)}
    return tuple(g[a] if isinstance(a, str) and a in g else a for a in spec)


def _desc(out, args):
    """What a value's consumers read: per tensor its sizes, strides, offset, dtype, device, and
    which argument's storage it shares (None: its own)."""
    def one(t):
        shares = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                       and a.untyped_storage()._cdata == t.untyped_storage()._cdata), None)
        return (isinstance(t, FakeTensor), tuple(t.shape), t.stride(), t.storage_offset(),
                t.dtype, t.device, shares)
    return [one(t) for t in out] if isinstance(out, (tuple, list)) else one(out)


def test_every_meta_op_is_covered():
    covered = {op for op, _ in CASES}
    assert fv._META_OPS <= covered, fv._META_OPS - covered
    assert {op.name() for op in covered if op.namespace == "npuspec"} == fv._VERIFY_OPS


@pytest.mark.parametrize("op,spec", CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(CASES)])
def test_meta_kernel_value_is_the_mode_s(op, spec):
    mode = FakeTensorMode()
    args = _args(spec, _inputs(mode), mode)
    fast = fv._from_meta_kernel(op, args, {})
    assert fast is not None, op
    with mode:
        want = op(*args)
    assert _desc(fast, args) == _desc(want, args)
    got = fv.fake_value(op, args)
    assert _desc(got, args) == _desc(want, args)
    leaves = fast if isinstance(fast, (tuple, list)) else (fast,)
    assert all(t.fake_mode is mode for t in leaves)


def test_anything_else_goes_through_the_mode():
    mode = FakeTensorMode()
    g = _inputs(mode)
    # an op outside the set: the mode's dispatch, same value
    assert fv._from_meta_kernel(aten.rand_like.default, (g["u"],), {}) is None
    assert fv._from_meta_kernel(aten.nonzero.default, (g["ok"],), {}) is None
    with mode:
        want = aten.exp.default(g["p"])
    assert _desc(fv.fake_value(aten.exp.default, (g["p"],)), (g["p"],)) == _desc(want, (g["p"],))
    # a real tensor beside a fake one, a tensor of another mode, a lifted constant
    assert fv._from_meta_kernel(aten.add.Tensor, (g["u"], torch.ones(B, K)), {}) is None
    other = _inputs(FakeTensorMode())
    assert fv._from_meta_kernel(aten.add.Tensor, (g["u"], other["u"]), {}) is None
    with mode:
        c = torch.tensor(2.0)  # made under the mode: it keeps its value
    assert c.constant is not None
    assert fv._from_meta_kernel(aten.mul.Tensor, (g["u"], c), {}) is None
    # symbolic sizes
    sym = FakeTensorMode(shape_env=ShapeEnv())
    x = sym.from_tensor(torch.empty(5, 4), static_shapes=False)
    assert not isinstance(x.shape[0], int)
    assert fv._from_meta_kernel(aten.unsqueeze.default, (x, 1), {}) is None
    with sym:
        assert fv.fake_value(aten.unsqueeze.default, (x, 1)).dim() == 3


def test_pointwise_shortcut_only_for_contiguous_inputs():
    """The shortcut (an empty meta tensor) is taken for inputs each contiguous in its own
    shape, and the meta kernel runs for a strided, expanded or offset input."""
    mode = FakeTensorMode()
    g = _inputs(mode)

    def take(op, *a):
        return fv._pointwise_dtype(op, a, {}, [x for x in a if isinstance(x, torch.Tensor)])
    assert take(aten.lt.Tensor, g["u"], g["u"]) is torch.bool
    assert take(aten.add.Tensor, g["ids"], g["ii"]) is torch.int64
    assert take(aten.where.self, g["ok"], g["ii"], g["u"]) is torch.float32
    for other in ("ux", "us"):
        assert take(aten.lt.Tensor, g["u"], g[other]) is None
    assert take(aten.ge.Scalar, g["pt"], 0.1) is None
    assert take(aten.where.self, g["ok"][:, :1], g["u"], g["u"]) is None
    with mode:  # broadcast operands, each contiguous in its own shape
        assert take(aten.lt.Tensor, torch.empty(K), torch.empty(B, 1)) is torch.bool
        # a mask wider than the filled tensor is left to the meta kernel, which raises as the
        # mode does
        wide = torch.empty(B, K, V, dtype=torch.bool)
        assert take(aten.masked_fill.Scalar, g["u"], wide, 0.0) is None
    with pytest.raises(RuntimeError):
        fv.fake_value(aten.masked_fill.Scalar, (g["u"], wide, 0.0))
    assert fv._pointwise_dtype(aten.cumsum.default, (g["ok"], 1), {"dtype": torch.int32},
                               [g["ok"]]) is None
