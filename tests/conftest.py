"""Suite-wide collection order: the slowest tests first.

pytest-xdist hands tests to its workers in collection order. A 30-60 s test collected last
runs alone on one core at the end of the run while the other worker idles; started first, it
overlaps the many short tests. Listed here: tests over ~9 s in `pytest --durations=60` on a
2-core machine (node-id prefixes, slowest first). A stale entry only changes the order;
nothing is skipped or added.
"""
from __future__ import annotations

import os

# Inductor compiles C++ in a pool of 2 subprocesses on a 2-core machine, each importing torch
# (~5 s CPU) in every process that compiles: pytest's workers and the engine, server and TP
# rank processes the tests start. With both cores already busy with xdist's two workers, the
# pool buys no wall time: one thread measured 41 s of CPU against 51 s for a cold engine build
# (and 32 s wall against 35 s). Set before anything imports torch._inductor's config, and
# inherited by the subprocesses.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# K is fixed unless a test asks for the online controller (k_controller "online" or
# num_speculative_tokens "auto"): the engine's default captures one graph set per K of
# {0, 1, 2, 4, ..., K} and times each at start-up, which the suite's hundreds of engine builds
# cannot afford, and a test about another subject then gets the K it wrote. The controller's
# own tests (tests/spec_decode/test_k_controller.py, tests/engine/test_online_k.py) ask for it,
# and tests/test_config.py checks the default with this variable unset.
os.environ.setdefault("NPUSPEC_K_CONTROLLER", "fixed")

SLOWEST_FIRST = (
    "tests/engine/test_tp.py::test_compiled_tp2_equals_tp1_and_seeded_sampling_matches",
    "tests/engine/test_bf16_identity.py::test_bf16_captured_speculative_greedy",
    "tests/passes/test_search_memo.py::test_no_spelling_changes_its_graph_only_at_some_sizes",
    "tests/engine/test_tp.py::test_greedy_tp2_equals_tp1[eagle3-tp2]",
    "tests/models/test_quant.py::test_engine_runs_stored_weights_captured_and_speculation_is_exact",
    "tests/cache/test_trust_faults.py::test_links_in_world_writable_dirs_through_real_starts",
    "tests/cache/test_processes.py::test_cold_processes_at_once[4]",
    "tests/engine/test_compiled_signature.py::test_an_engine_s_compiled_steps_do_not_outlive_it",
    "tests/engine/test_hidden_state_drafters.py::test_batch_size_k_table",
    "tests/cache/test_processes.py::test_cold_then_warm_process_inductor",
    "tests/engine/test_block_drafters.py::test_batch_size_k_table",
    "tests/engine/test_hidden_state_drafters.py::test_greedy_identical_and_captured_equals_eager",
    "tests/cli/test_bench_serve.py",
    "tests/serve/test_server.py",
    "tests/engine/test_compiled.py::test_ngram_dynamic_k_swaps_graph_sets_without_recapture",
    "tests/engine/test_online_k.py::test_captured_ngram_greedy_equals_plain_with_k_changing",
    "tests/passes/test_heldout_corpus.py::test_inductor_lowering_equals_eager[vllm_ascend_block",
    "tests/graphs/test_hf_generate.py",
    "tests/engine/test_hybrid_drafter.py::test_greedy_equals_plain_uncompiled_and_captured",
    "tests/engine/test_block_drafters.py::test_greedy_identical_and_captured_equals_eager",
    "tests/engine/test_block_drafters.py::test_confidence_budget_cuts_drafts_not_outputs",
    "tests/serve/test_serve_cli.py::test_tensor_parallel",
    "tests/kernels/test_rejection_sample.py::test_triton_interpreter_equals_reference",
    "tests/kernels/test_paged_attention_triton.py::test_interpreter_cases",
    "tests/passes/test_composed_ragged.py::test_near_misses_are_left_as_written",
    "tests/kernels/test_shm_collectives.py",
    "tests/engine/test_tp.py",
    "tests/test_backend_install.py",
    "tests/models/test_gguf.py::test_greedy_generation_matches_transformers",
    "tests/engine/test_hidden_state_lossless.py",
)


def _rank(nodeid: str) -> int:
    for i, prefix in enumerate(SLOWEST_FIRST):
        if nodeid.startswith(prefix):
            return i
    return len(SLOWEST_FIRST)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: the rest keep their order
