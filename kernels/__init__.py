"""npuspec.kernels: custom ops (torch.library), their PyTorch references, Triton kernels, CPU lowering."""
import functools
import importlib
import threading

from npuspec.kernels.verify import (  # noqa: F401  (registers torch.ops.npuspec.rejection_sample)
    conditional_rates,
    rejection_sample,
    rejection_sample_reference,
    synthetic_rates_from_length,
)
from npuspec.kernels import accept  # noqa: F401,E402  (registers npuspec::greedy_accept, ratio_accept, residual_*)
from npuspec.kernels.cpp_build import vec_isa


@functools.lru_cache(maxsize=None)
def prebuild_cpu_kernels() -> None:
    """Compile the CPU kernels' C++ (packed and quantized linear, add+RMSNorm, paged attention,
    fused verify, the suffix and n-gram proposers, then the native ops that dispatch to them)
    on two background threads.

    Each library compiles on first use (g++, 1-4 s apiece once Inductor's precompiled
    cpp_prefix.h exists; the first build makes it, ~8 s, kernels/cpp_build.py). An engine
    starts this before it loads its model, so the compiles, and the header Inductor's own
    kernels then reuse, overlap loading, packing and Dynamo's tracing instead of adding to
    them. Packing waits only for the vector-ISA probe, which each thread runs first. A first
    use that comes early waits on Inductor's per-library file lock and loads the finished
    library. Runs once per process; failures are logged by the loaders."""
    # Inductor's modules are imported here, on the caller's thread, before any thread
    # starts: two threads importing them at once can meet a partly initialised module (a
    # worker rank once failed with "cannot import name 'IndentedBuffer' from partially
    # initialized module 'torch._inductor.utils'"); the engine imports them anyway
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.cpp_builder  # noqa: F401
    import torch._inductor.cpu_vec_isa  # noqa: F401
    # two g++ runs at a time (these machines have 2+ cores)
    # the native ops last: their library waits for the kernels it calls (kernels/native_cpu.py)
    for chain in (("linear_packed_cpu", "paged_attention_cpu", "linear_quant_cpu", "k_controller_cpu",
                   "race_rows_cpu"),
                  ("rms_norm_cpu", "verify_cpu", "suffix_cpu", "ngram_cpu", "native_cpu")):
        threading.Thread(target=_prebuild, args=(chain,), name="npuspec-prebuild",
                         daemon=True).start()


def _prebuild(names: tuple[str, ...]) -> None:
    vec_isa()  # first: packing a model at load waits for it (linear_packed_cpu.block_width)
    for name in names:
        importlib.import_module(f"npuspec.kernels.{name}").available()
