"""Turn a Dynamo FX graph into a callable: run npuspec's verify passes, then lower.

Lowerings (options["lowering"]):
- "inductor": torch._inductor.compile_fx (C++ on CPU, Triton on CUDA). The verify passes run
  inside Inductor as its `joint_custom_pre_pass` (`npuspec.passes.InductorVerifyPass`), on the
  ATen graph AOT autograd produced, so Inductor's FX graph cache keys include the passes'
  uuid() (and on a hit the passes' counts are replayed: pass_counts.py). `fallback_random=True`
  keeps torch.rand/exponential_/multinomial the eager ops, so a compiled step draws the same
  numbers as eager from the same RNG state.
- "eager": AOT autograd traces the Dynamo graph to ATen (no decompositions), the passes run on
  it, and the rewritten graph runs op by op.
- "torchair": the passes run on the ATen graph as for "eager", then torch_npu's torchair NPU
  backend lowers it (Ascend only; imported only there). With a cache directory, GE's graph
  compile cache is pointed at the cache entry (graphs/cache/torchair.py).

Small-M linears (Inductor lowering, CPU, inference graphs): `SmallMLinearPass`, Inductor's
`post_grad_custom_pre_pass`, replaces `mm(x, w.T)` / `addmm(b, x, w.T)` on an fp32 CPU weight
that is a graph input (a parameter) by `npuspec::linear_rows(x, w, b)`, which streams the weight
once for the few rows of a decode step and calls MKL for more than `SMALL_M_MAX` rows (and for
one row). A static row count outside 2..SMALL_M_MAX is left to Inductor's own mm
(kernels/linear_cpu.py; docs/graphs.md, "Compiled step vs eager on a real model").

Why ATen and not the Dynamo graph: Dynamo keeps every user spelling (`x == y`, `torch.eq`,
`x.cumprod(1)`, `torch.cumprod(x, dim=-1)`, methods vs functions); AOT tracing normalises them to
one ATen op each, so one traced pattern per idiom covers them all.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Optional, Any, Callable

import torch
from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

from npuspec import counters
from npuspec._counters import first_time
from npuspec.compilation import pass_counts
from npuspec.graphs.cache.torchair import compiler_config
from npuspec.kernels import linear_cpu
from npuspec.passes import InductorVerifyPass, run_passes
from npuspec.passes.hashing import source_hash

log = logging.getLogger("npuspec.backend")  # the backend's logger, as before the move

# The small-M linear rewrite (SmallMLinearPass); part of the graph cache key (lowering_key).
SMALL_M_LINEAR = True
# Smaller weights stay MKL's: there the custom op's per-call cost exceeds what streaming saves
# (docs/graphs.md, "Compiled step vs eager on a real model").
SMALL_M_MIN_WEIGHT_BYTES = 512 * 1024


def _is_weight_t(node: Any) -> Any:
    """The [N, K] fp32 CPU graph input `w` if `node` is w.T (permute [1, 0] or t), else None."""
    aten = torch.ops.aten
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    if node.target not in (aten.permute.default, aten.t.default):
        return None
    w = node.args[0]
    v = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
    if (w.op != "placeholder" or not isinstance(v, torch.Tensor) or v.dim() != 2
            or v.dtype != torch.float32 or v.device.type != "cpu" or not v.is_contiguous()):
        return None
    return w


def _rows_may_use_kernel(rows: Any) -> bool:
    """False for a static row count the kernel never takes (HF's one-token decode graph, a
    long prefill): there the op would only wrap torch.mm in a Python custom-op call (~20-45 us
    each, 150+ per SmolLM2 token) and hide the mm from Inductor. A symbolic count is kept: one
    graph serves every batch size and the op picks per call."""
    return isinstance(rows, torch.SymInt) or linear_cpu.kernel_takes_rows(int(rows))


class SmallMLinearPass(CustomInferenceAwareGraphPass):
    """mm(x, w.T) / addmm(b, x, w.T) -> npuspec::linear_rows(x, w, b) on inference graphs
    whose weight w is an fp32 CPU graph input. The op picks the kernel or MKL per call from
    the row count, so one graph serves every (dynamic) batch size."""

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = True) -> None:
        if not is_inference:
            return
        aten = torch.ops.aten
        n_rewritten = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default,
                                                                  aten.addmm.default):
                continue
            if node.kwargs:  # addmm's beta/alpha
                continue
            if node.target is aten.mm.default:
                bias, x, wt = None, node.args[0], node.args[1]
            else:
                bias, x, wt = node.args[0], node.args[1], node.args[2]
                bv = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
                if not isinstance(bv, torch.Tensor) or bv.dim() != 1 or bv.dtype != torch.float32:
                    continue
            w = _is_weight_t(wt)
            xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
            if w is None or not isinstance(xv, torch.Tensor) or xv.dtype != torch.float32:
                continue
            if w.meta["val"].numel() * 4 < SMALL_M_MIN_WEIGHT_BYTES:
                continue
            if not _rows_may_use_kernel(xv.shape[0]):
                continue
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.npuspec.linear_rows.default, (x, w, bias))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            n_rewritten += 1
        if n_rewritten:
            graph.eliminate_dead_code()
            counters.bump("small_m_linears", n_rewritten)
            log.info("npuspec: %d linears -> npuspec::linear_rows", n_rewritten)

    def uuid(self) -> str:
        return small_m_linear_uuid()


def small_m_linear_uuid() -> str:
    """Hash of the pass, the kernel and its row limit (Inductor's FX cache and npuspec's key)."""
    src = (source_hash(SmallMLinearPass, _is_weight_t, _rows_may_use_kernel, linear_cpu.uses_kernel,
                       linear_cpu.kernel_takes_rows) + linear_cpu._SOURCE)
    limits = f"{linear_cpu.SMALL_M_MIN}|{linear_cpu.SMALL_M_MAX}|{SMALL_M_MIN_WEIGHT_BYTES}"
    return hashlib.sha256(f"{src}|{limits}".encode()).hexdigest()


def lowering_key(opts: Any) -> dict:
    """Lowering settings that change the generated code, beyond the lowering's name and mode
    (cache_keys.py puts them in the cache key)."""
    if getattr(opts, "lowering", None) != "inductor":
        return {}
    return {"small_m_linear": small_m_linear_uuid() if SMALL_M_LINEAR else None}


# namespaces whose ops' fakes are trusted to describe their outputs' layout (ATen's meta
# functions, npuspec's own: tests/kernels/test_fake_strides.py)
TRUSTED_OP_NAMESPACES = frozenset({"aten", "prims", "npuspec"})


def foreign_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Ops of `gm` from other namespaces (a user's custom ops), by name."""
    names = set()
    for n in gm.graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            continue
        qualified = t._schema.name if isinstance(t, torch._ops.OpOverload) else t._qualified_op_name
        if qualified.split("::")[0] not in TRUSTED_OP_NAMESPACES:
            names.add(qualified)
    return sorted(names)


def inductor_config_patches(opts: Any, gm: Optional[torch.fx.GraphModule] = None) -> dict:
    """Inductor config for the npuspec lowering (also what the pass benchmark uses). `gm`: the
    graph to compile; its layout checks stay on when it calls ops from other namespaces."""
    patches = {}
    if getattr(opts, "mode", None):
        patches.update(torch._inductor.list_mode_options(opts.mode))
    patches["joint_custom_pre_pass"] = InductorVerifyPass(uuid_extra=pass_counts.record_uuid())
    patches["fallback_random"] = True
    # The generated wrapper checks every input's and every extern op's output size and stride
    # (assert_size_stride, ~0.8 us each: 487 a SmolLM2 decode step, ~0.4 ms of its 10-20). The
    # inputs are Dynamo's guards' business already, and npuspec's ops return what their fakes
    # say (tests/kernels/test_fake_strides.py); a graph with a user's custom op keeps the checks,
    # since the generated code would index a mislaid output by the fake's strides.
    patches["size_asserts"] = gm is None or bool(foreign_ops(gm))
    if SMALL_M_LINEAR:
        patches["post_grad_custom_pre_pass"] = SmallMLinearPass()
    return patches


def lower_inductor(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    from torch._inductor.compile_fx import compile_fx  # heavy: only once this lowering runs

    from torch._inductor.exc import InductorError

    patches = inductor_config_patches(opts, gm)
    key = pass_counts.graph_key(gm, example_inputs, patches)
    before, runs = counters.snapshot(), InductorVerifyPass.runs
    try:
        fn = compile_fx(gm, example_inputs, config_patches=patches)
    except InductorError as e:
        return _inductor_failed(e, gm, example_inputs, opts, before)
    pass_counts.carry(key, before, ran=InductorVerifyPass.runs != runs)
    return fn


def _inductor_failed(e: Exception, gm: torch.fx.GraphModule, example_inputs: list, opts: Any,
                     before: dict) -> Callable:
    """Inductor could not compile this graph (its own failure, e.g. a codegen KeyError on
    vLLM v1's ragged sampler written as per-request loops, which stock backend="inductor"
    raises too): lower it eagerly instead, with the verify passes, so the step still runs and
    equals eager. What the failed attempt counted is taken back (the eager lowering's passes
    count again); logged once per error, counted in `inductor_fallbacks`."""
    inner = getattr(e, "inner_exception", e)
    for name, n in counters.delta(before).items():
        if name.split(".")[0] in (*pass_counts.PASS_COUNTERS, "canonical_rewrites"):
            counters.bump(name, -n)
    counters.bump("inductor_fallbacks")
    msg = f"{type(inner).__name__}: {inner}".splitlines()[0][:300]
    if first_time(("inductor_failed", msg)):
        log.warning("npuspec backend: Inductor failed to compile a graph (%s); running it with "
                    "the eager lowering instead (verify passes included). To skip the attempt "
                    "pass options={'lowering': 'eager'}.", msg)
    return lower_eager(gm, example_inputs, opts)


def _aot_with_passes(gm: torch.fx.GraphModule, example_inputs: list, inner: Callable) -> Callable:
    """AOT-trace to ATen (no decompositions), run the verify passes, then `inner(fw, inputs)`."""
    from torch._functorch.aot_autograd import aot_module_simplified  # heavy: only when lowering

    def fw_compiler(fw: torch.fx.GraphModule, fw_inputs: list):
        run_passes(fw, flavor="aten")
        return inner(fw, fw_inputs)

    return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, decompositions={})


def lower_eager(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    from functorch.compile import make_boxed_func  # heavy (AOT autograd): only when lowering

    return _aot_with_passes(gm, example_inputs, lambda fw, _: make_boxed_func(fw.forward))


def lower_torchair(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    # Only reachable on npu (BackendOptions refuses torchair elsewhere). Never run on an NPU
    # here: tests/cache uses a fake torchair.
    from functorch.compile import make_boxed_func  # heavy (AOT autograd): only when lowering
    from torch_npu.dynamo import torchair  # optional: Ascend only

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
