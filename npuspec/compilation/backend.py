"""The `npuspec` torch.compile backend (docs/design.md, "The backend and its options").

    torch.compile(step, backend="npuspec", options={...})

is found through the `torch_dynamo_backends` entry point, so it works in a process that never
imported npuspec. Per Dynamo graph it: notes a graph break (`graph_breaks`), validates the
options, loads the lowered graph from the graph cache or lowers it (`cache.cached_lower` around
`lowering.lower`, in which the verify passes run), then wraps the result in the graph-capture
dispatcher (`npuspec.graphs`).
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch._inductor import list_mode_options

from npuspec import envs
from npuspec.compilation import lowering
from npuspec.compilation.cache import cached_lower, record_artifact
from npuspec.compilation.graph_breaks import note_graph_break
from npuspec.config import SpeculativeConfig
from npuspec.graphs import wrap_compiled
from npuspec.graphs.layout import check_token_groups
from npuspec.graphs.step import planned_sizes
from npuspec.kernels.verify import kernel_config
from npuspec.passes.manager import TOTALS as PASS_TOTALS
from npuspec.platform import Platform, current_platform

# the name users and tests know (README): it predates the package's move to compilation/
log = logging.getLogger("npuspec.backend")

try:  # Dynamo re-raises a ShortenTraceback from a backend as is, where it wraps any other
    # exception in BackendCompilerFailed (torch/_dynamo/output_graph.py, _call_user_compiler)
    from torch._dynamo.exc import ShortenTraceback as _Unwrapped
except ImportError:  # a torch without it: the message still reaches the user, inside the wrapper
    _Unwrapped = ValueError


class BackendUserError(_Unwrapped, ValueError):
    """A bad option or NPUSPEC_* value found at the backend's entry: the user's to fix, so it
    reaches torch.compile's caller as itself (a ValueError), not as BackendCompilerFailed."""

    def __init__(self, message: str):
        if _Unwrapped is ValueError:
            super().__init__(message)
        else:  # no frame to cut the traceback at: Dynamo keeps ours
            super().__init__(message, first_useful_frame=None)

LOWERINGS = ("inductor", "eager", "torchair")
CAPTURE_MODES = (True, False, "lazy")
DEFAULT_MAX_NUM_SEQS = 256


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    speculative_config: Optional[SpeculativeConfig] = None
    capture_sizes: Optional[tuple[int, ...]] = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    cache_dir: Optional[str] = None
    lowering: str = "inductor"
    capture: Any = True  # True | False | "lazy"
    mode: Optional[str] = None  # torch.compile(mode=...), forwarded to Inductor

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "mode")

    @classmethod
    def from_dict(cls, options: Optional[dict], mode: Optional[str] = None,
                  platform: Optional[Platform] = None) -> "BackendOptions":
        plat = platform or current_platform()
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"npuspec backend: options={options!r} must be a dict such as "
                             f"{{'lowering': 'eager', 'max_num_seqs': 8}} (or None)")
        o = dict(options or {})
        for k in o:
            if k == "mode":
                raise ValueError("npuspec backend: options['mode'] is not an option; pass "
                                 "torch.compile(..., mode=...) instead")
            if k not in cls.keys():
                near = difflib.get_close_matches(str(k), cls.keys(), n=1, cutoff=0.5)
                hint = f"did you mean {near[0]!r}?" if near else f"valid options: {', '.join(cls.keys())}"
                raise ValueError(f"npuspec backend: unknown option {k!r}; {hint}")
        spec = o.get("speculative_config")
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_dict(spec, device=plat.device)
        sizes = o.get("capture_sizes")
        if sizes is not None:
            if (not isinstance(sizes, (list, tuple)) or not sizes
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)):
                raise ValueError(f"npuspec backend: options['capture_sizes']={sizes!r} must be a "
                                 f"non-empty list of positive integers, e.g. [4, 8, 16]")
            sizes = tuple(sizes)
        mns = o.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        if isinstance(mns, bool) or not isinstance(mns, int) or mns < 1:
            raise ValueError(f"npuspec backend: options['max_num_seqs']={mns!r} must be an "
                             f"integer >= 1")
        cache_dir = o.get("cache_dir", envs.cache_dir())
        if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir):
            raise ValueError(f"npuspec backend: options['cache_dir']={cache_dir!r} must be a "
                             f"directory path (or leave it out for no persistent cache)")
        if "cache_dir" in o and cache_dir is not None:  # the env value was checked by envs
            cache_dir = envs.parse_dir("npuspec backend: options['cache_dir']", cache_dir,
                                       "or leave it out for no persistent cache")
        lowering = o.get("lowering", default_lowering(plat))
        if lowering not in LOWERINGS:
            raise ValueError(f"npuspec backend: options['lowering']={lowering!r} must be one of "
                             f"{', '.join(LOWERINGS)}")
        if lowering == "torchair" and plat.device != "npu":
            raise ValueError(f"npuspec backend: options['lowering']='torchair' needs an Ascend NPU "
                             f"(this platform is {plat.device}); use 'inductor' or 'eager'")
        capture = o.get("capture", True)
        if not (capture is True or capture is False or capture == "lazy"):
            raise ValueError(f"npuspec backend: options['capture']={capture!r} must be True, "
                             f"False or 'lazy'")
        modes = _inductor_modes()
        if mode is not None and mode not in modes:
            raise ValueError(f"npuspec backend: mode={mode!r} is not a torch.compile mode; use "
                             f"one of {', '.join(map(repr, modes))}, or drop mode=")
        if mode not in (None, "default") and lowering != "inductor":
            raise ValueError(f"npuspec backend: mode={mode!r} applies to the Inductor lowering "
                             f"only; drop mode= or use options['lowering']='inductor'")
        return cls(spec, sizes, mns, cache_dir, lowering, capture,
                   None if mode == "default" else mode)


def _inductor_modes() -> tuple[str, ...]:
    return tuple(list_mode_options())


def default_lowering(plat: Platform) -> str:
    return "torchair" if plat.device == "npu" else "inductor"


# Seconds over the process inside the backend and inside the lowering it calls (Inductor's
# compile_fx, torchair, eager), for `own_seconds`.
TIMES = {"graphs": 0, "seconds": 0.0, "lowering_seconds": 0.0}


def own_seconds() -> float:
    """npuspec's own compile-time seconds so far in this process: its backend's work outside
    the lowering (cache keys, the graph cache, capture wiring) plus its passes, which run inside
    the lowering. Beside Inductor's time for the same graphs, this is what npuspec adds
    (`npuspec bench hf --start` reports it for the new-lengths run)."""
    return TIMES["seconds"] - TIMES["lowering_seconds"] + PASS_TOTALS["seconds"]


def _timed_lower(gm: torch.fx.GraphModule, example_inputs: list, opts: Any) -> Callable:
    t0 = time.perf_counter()
    try:
        return lowering.lower(gm, example_inputs, opts)
    finally:
        TIMES["lowering_seconds"] += time.perf_counter() - t0


def npuspec_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                    options: Optional[dict] = None, mode: Optional[str] = None) -> Callable:
    """Dynamo backend entry point."""
    t0 = time.perf_counter()
    try:
        return _backend(gm, example_inputs, options, mode)
    finally:
        TIMES["graphs"] += 1
        TIMES["seconds"] += time.perf_counter() - t0


def _backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Optional[dict],
             mode: Optional[str]) -> Callable:
    note_graph_break(gm)  # a graph Dynamo ended at a break: say where, once per line

    try:  # every check before any work (issue 16): bad env values, options, token groups
        envs.check_all()
        plat = current_platform()
        opts = BackendOptions.from_dict(options, mode=mode, platform=plat)
        check_token_groups(gm)
    except ValueError as e:
        raise BackendUserError(str(e)) from e
    log.info("npuspec: compiling a graph of %d nodes on %s with lowering=%s capture=%s",
             len(gm.graph.nodes), plat.device, opts.lowering, opts.capture)
    # Graph cache (compilation/cache.py, docs/cache.md): load the lowered graph from
    # opts.cache_dir, or lower it and publish it there; without a cache_dir: lowering.lower.
    compiled = cached_lower(gm, list(example_inputs), opts, _timed_lower)
    # capture wiring (issue 5): pad, replay, slice
    wrapped = wrap_compiled(gm, example_inputs, compiled, opts, plat)
    _record_artifacts(opts, plat)
    return wrapped


def _record_artifacts(opts: BackendOptions, plat: Platform) -> None:
    """Plain-JSON facts about this compile, kept in the graph cache entry (no-op without one)."""
    if opts.speculative_config is not None and opts.capture is not False:
        plans = {k: planned_sizes(k, opts, plat) for k in opts.speculative_config.k_values()}
        record_artifact("capture_plan", {"max_num_seqs": opts.max_num_seqs,
                                         "sizes_per_k": {str(k): v for k, v in plans.items()}})
    record_artifact("verify_kernel", kernel_config(plat.device))
