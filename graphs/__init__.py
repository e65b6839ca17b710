"""npuspec.graphs: capture planning, graph runners (ACL / CUDA / CPU), padding dispatch, graph
sets per K, and (in graphs/cache) the shared graph cache directory. See docs/graphs.md."""
from npuspec.graphs.plan import (  # noqa: F401
    MAX_CAPTURE_TOKENS,
    CaptureSizeWarning,
    default_ladder,
    max_capture_tokens,
    plan_capture_sets,
    plan_capture_sizes,
)
from npuspec.graphs.runners import (  # noqa: F401
    AclGraphRunner,
    CpuRunner,
    CudaGraphRunner,
    Runner,
    make_runner,
    shared_pool,
)
from npuspec.graphs.dispatch import COPY, CONST, INT, STATIC, TOKEN, GraphSet, Slot, token  # noqa: F401
from npuspec.graphs.layout import mark_token_dim  # noqa: F401
from npuspec.graphs.step import StepDispatcher, live_dispatchers, wrap_compiled  # noqa: F401
