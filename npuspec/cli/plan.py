"""Print the graph capture plan for a speculative config.

For every K the config can use (one per range of `num_speculative_tokens_per_batch_size`, or
`num_speculative_tokens`), it lists the capture sizes (token counts, each a multiple of K+1)
from `npuspec.graphs.plan_capture_sizes`, which batch sizes use that K, how much padding they
carry on average, and the total graph count. It warns where batches that use a K need more
tokens than its largest captured size: those steps run eagerly (slow, and counted as
`eager_fallbacks`).

    npuspec plan --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' --max-num-seqs 64
"""
from __future__ import annotations

import argparse

from npuspec.cli_util.flags import int_list, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", required=True, metavar="JSON",
                   help="speculative config (vllm serve --speculative-config schema), inline JSON or a .json file")
    p.add_argument("--max-num-seqs", type=_max_num_seqs, default=64,
                   help=f"most concurrent requests (default 64, at most {MAX_PLANNED_SEQS})")
    p.add_argument("--capture-sizes", type=int_list, default=None, metavar="N,N,...",
                   help="token counts to capture (default: NPUSPEC_CAPTURE_SIZES, else the default ladder)")
    p.add_argument("--device", choices=("npu", "cuda", "cpu"), default=None,
                   help="plan for this device (default: the one detected); npu enforces K+1 <= 16")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")


# plan_run.build_plan walks every batch size; beyond this the walk takes minutes, and batches
# that large exceed the largest capture size (4096 tokens) whatever K is
MAX_PLANNED_SEQS = 65536


def _max_num_seqs(s: str) -> int:
    v = positive(s)
    if v > MAX_PLANNED_SEQS:
        raise argparse.ArgumentTypeError(f"{v} is more than {MAX_PLANNED_SEQS}, the most this plan "
                                         f"covers (larger batches are never captured); use a "
                                         f"smaller value")
    return v


def run(args) -> int:
    from npuspec.cli import plan_run  # heavy: keeps `--help` and flag errors off torch's import
    return plan_run.run(args)
