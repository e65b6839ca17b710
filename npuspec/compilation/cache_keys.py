"""Cache keys: what makes two compilations interchangeable (docs/cache.md, "Key derivation").

key = sha256(canonical JSON of KeyParts), where KeyParts holds
- graph:       sha256 of the graph's node lines (graph_text.py: the root GraphModule's and
               every nested one's, in module order) and of every tensor constant (get_attr)
- inputs:      dtype / shape / stride / device of each example input (shapes are not in the code)
- passes:      the pass manager's uuids, in order (each hashes its pass's source and config)
- capture:     the capture plan's inputs: options["capture_sizes"], NPUSPEC_CAPTURE_SIZES,
               capture mode, max_num_seqs (with ks and the platform they determine the plan)
- ks:          the K set (one graph set per K)
- spec:        the SpeculativeConfig fields that change what gets compiled (COMPILE_FIELDS)
- lowering:    "inductor" / "eager" / "torchair", the Inductor mode, and the lowering's own
               code-changing settings (lowering.lowering_key: the small-M linear pass)
- fingerprint: the platform (see `fingerprint()`)

Why this lives in npuspec.compilation and not with the store in npuspec.graphs.cache: a key
names a compilation, so it hashes the passes' uuids and the lowering's settings; the store
below knows only entries under a hex key. The backend hook wraps `lowering.lower`, inside which the verify passes run (for
Inductor as its joint_custom_pre_pass); hashing the pre-pass code together with the pass uuids
names the post-pass graph exactly (the passes are deterministic functions of the graph and
their config, which the uuids hash).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import platform as _pyplatform
import sys
from typing import Any, Optional, Sequence

import torch

import npuspec
import npuspec.passes
import npuspec.platform  # current_platform is looked up per call: tests stand in a platform
from npuspec import envs
from npuspec.compilation.graph_text import graph_text
from npuspec.compilation import lowering

# Bump when the layout of an entry or the meaning of a key component changes.
KEY_FORMAT = 2  # 2: the graph hashed by its node lines (graph_text), not gm.code

# SpeculativeConfig fields that change the compiled graphs or kernels. Proposer-only settings
# (prompt_lookup_*, suffix_decoding_*) and the draft model path are left out: they run eagerly
# or are compiled as their own graphs, whose code is hashed when they are compiled.
COMPILE_FIELDS = (
    "method",
    "num_speculative_tokens",
    "num_speculative_tokens_per_batch_size",
    "rejection_sample_method",
    "synthetic_acceptance_rates",
    "synthetic_acceptance_length",
    "disable_padded_drafter_batch",
    "rejection_sampler_config",
    "dynamic_spec_config",
)

# CPU feature flags that change the code Inductor's C++ backend emits and can run.
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve", "bf16", "fp16", "vsx", "vx")


@dataclasses.dataclass(frozen=True)
class KeyParts:
    graph: str
    inputs: tuple = ()
    passes: tuple = ()
    capture: Any = None
    ks: tuple = ()
    spec: Any = None
    lowering: Any = None
    fingerprint: Any = None

    def to_json(self) -> dict:
        return {"format": KEY_FORMAT, **dataclasses.asdict(self)}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def _json_default(o: Any):
    if isinstance(o, (tuple, set, frozenset)):
        return sorted(o) if isinstance(o, (set, frozenset)) else list(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return repr(o)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def cache_key(parts: KeyParts) -> str:
    return sha256_hex(canonical_json(parts.to_json()))


# -- components ---------------------------------------------------------------------------

def graph_hash(gm: Any) -> str:
    """sha256 over the node lines of `gm` and its nested GraphModules (graph_text) and its
    tensor constants."""
    h = hashlib.sha256(graph_text(gm).encode())
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            v = _getattr_path(gm, node.target)
        except AttributeError:
            continue
        if isinstance(v, torch.Tensor):
            h.update(f"const {node.target} {tensor_meta(v)}\n".encode())
            if v.device.type != "meta":
                h.update(v.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _getattr_path(obj: Any, target: str) -> Any:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def tensor_meta(t: Any) -> str:
    return (f"{t.dtype}|{tuple(str(s) for s in t.shape)}|{tuple(str(s) for s in t.stride())}"
            f"|{t.device.type}|{int(bool(t.requires_grad))}")


def inputs_meta(example_inputs: Sequence[Any]) -> tuple:
    out = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            out.append(tensor_meta(x))
        elif isinstance(x, (int, float, bool)) or x is None:
            out.append(f"{type(x).__name__}:{x!r}")
        else:  # SymInt and friends: the symbol, not a value
            out.append(f"{type(x).__name__}:{x}")
    return tuple(out)


def spec_fields(spec: Any) -> Optional[dict]:
    """The compile-relevant SpeculativeConfig fields (None without a config)."""
    if spec is None:
        return None
    d = spec.to_dict()
    return {k: d[k] for k in COMPILE_FIELDS if k in d}


def _dist_version(*names: str) -> Optional[str]:
    for n in names:
        try:
            return f"{n}=={importlib.metadata.version(n)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cpu_isa() -> str:
    """A short hash of the ISA-relevant CPU flags (C++ kernels are built for them)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() in ("flags", "Features", "features"):
                    flags.update(x for x in v.split() if x.startswith(_ISA_PREFIXES))
                    break
    except OSError:
        pass
    return sha256_hex(" ".join(sorted(flags)))[:16] if flags else "unknown"


def _cann_version() -> str:
    v = getattr(getattr(torch, "version", None), "cann", None)
    if v:
        return str(v)
    home = envs.ascend_toolkit_home()
    for rel in ("version.cfg", "ascend_toolkit_install.info", "../version.cfg"):
        if not home:
            break
        try:
            with open(os.path.join(home, rel)) as f:
                for line in f:
                    if "version=" in line:
                        return line.split("version=", 1)[1].strip()
        except OSError:
            continue
    return "unknown"


@functools.lru_cache(maxsize=8)
def _fingerprint(device: str, device_name: str) -> tuple:
    fp = {
        "device": device,
        "device_name": device_name,
        "machine": _pyplatform.machine(),
        "torch": torch.__version__,
        "triton": _dist_version("triton-ascend", "triton") if device == "npu"
        else _dist_version("triton", "pytorch-triton"),
        "npuspec": npuspec.__version__,
        "python": f"{sys.implementation.name}-{_pyplatform.python_version()}",
    }
    if device == "npu":
        import torch_npu  # only reached on npu (the platform imported it already)

        fp["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
        fp["cann"] = _cann_version()
    if device == "cpu":
        fp["cpu_isa"] = _cpu_isa()
    if device == "cuda":
        fp["cuda"] = torch.version.cuda
    return tuple(sorted(fp.items()))


def fingerprint(platform: Any = None) -> dict:
    """Platform fingerprint: device kind and name, torch (+ torch_npu, CANN on npu), triton or
    triton-ascend, npuspec, Python; plus the CPU ISA flags on cpu and CUDA version on cuda."""
    plat = platform or npuspec.platform.current_platform()
    return dict(_fingerprint(plat.device, plat.device_name))


def fingerprint_tag(fp: dict) -> str:
    """Short tag for TORCH_COMPILE_CACHE_KEY_TAG (Inductor mixes it into its own keys)."""
    return "npuspec-" + sha256_hex(canonical_json(fp))[:16]


def pass_uuids() -> tuple:
    """The pass manager's uuids, in run order (npuspec.passes.pass_uuids)."""
    return tuple(str(u) for u in npuspec.passes.pass_uuids())


def _lowering_key(opts: Any) -> dict:
    """Lowering settings that change the generated code (lowering.lowering_key: the small-M
    linear rewrite's uuid for Inductor)."""
    return lowering.lowering_key(opts)


def key_parts(gm: Any, example_inputs: Sequence[Any], opts: Any, *,
              passes: Optional[Sequence[str]] = None, capture: Any = None,
              platform: Any = None) -> KeyParts:
    """Build the KeyParts for one backend call (`opts` is a BackendOptions)."""
    spec = getattr(opts, "speculative_config", None)
    ks = tuple(spec.k_values()) if spec is not None else ()
    if capture is None:
        # The capture plan is a pure function of these (npuspec.graphs.plan_capture_sets), the
        # K set and the platform; hashing its inputs avoids planning (and warning) twice.
        sizes = getattr(opts, "capture_sizes", None)
        try:
            env_sizes = envs.capture_sizes()
        except ValueError:  # the planner reports a malformed NPUSPEC_CAPTURE_SIZES itself
            env_sizes = "invalid"
        capture = {"sizes": list(sizes) if sizes else None, "env_sizes": env_sizes,
                   "mode": getattr(opts, "capture", None),
                   "max_num_seqs": getattr(opts, "max_num_seqs", None)}
    return KeyParts(
        graph=graph_hash(gm),
        inputs=inputs_meta(example_inputs),
        passes=tuple(passes) if passes is not None else pass_uuids(),
        capture=capture,
        ks=ks,
        spec=spec_fields(spec),
        lowering={"name": getattr(opts, "lowering", None), "mode": getattr(opts, "mode", None),
                  **_lowering_key(opts)},
        fingerprint=fingerprint(platform),
    )
