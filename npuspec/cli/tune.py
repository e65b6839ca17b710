"""`npuspec tune`: pick K per concurrency range from measured step latency and acceptance.

The model (all quantities measured, nothing assumed about the hardware):

  a_j      conditional acceptance at draft position j: P(draft j accepted | drafts 1..j-1 were);
           a missing draft counts as a rejection, since the step still pays for its slot.
  E(K)     expected tokens a request emits per step with K drafts
           = 1 + sum_{i=1..K} prod_{j<=i} a_j          (the bonus/recovered token, plus accepts)
  L(T)     latency of one decode step over T = B*(K+1) tokens (measured on a grid of token
           counts, made non-decreasing (padding to more tokens is always possible), linear in
           between, extended by the last slope beyond the largest)
  tps(B,K) = B * E(K) / (L(pad_K(B*(K+1))) + B*(h + d))   (d = drafting time per request-step,
           K > 0 only; h = the engine's other host work per request-step: inputs, the one
           device->host copy, bookkeeping; pad_K = the next capture size of K's graph set,
           which is what the step really runs)

For each batch size B (= concurrent requests) in 1..max_num_seqs the tuner takes the smallest K
whose tokens/s is within `tolerance` of the best (fewer distinct K = fewer graph sets; noise in
the latency does not flip K), then merges runs of equal K into the
`num_speculative_tokens_per_batch_size` ranges SpeculativeConfig takes: contiguous
[start_bs, end_bs, K] from batch size 1 to max_num_seqs (the last range also covers larger
batches, which inherit its K).

The measurement half (`measure_latency`, `measure_acceptance`) drives npuspec's engine; the
algorithm half is pure and unit-tested on synthetic inputs.
"""
from __future__ import annotations

import argparse

from npuspec.cli_util.flags import add_threads_flag, float_list, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="target checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--speculative-config", default=None,
                   help="base config (vllm serve schema); its num_speculative_tokens is the largest K "
                        "tried (default: ngram, K=4)")
    p.add_argument("--max-num-seqs", type=positive, default=64, help="largest concurrency to tune for (default 64)")
    p.add_argument("--max-tokens", type=positive, default=128, help="tokens per prompt when measuring acceptance")
    p.add_argument("--prompts", default=None, help="prompt file (.txt/.json/.jsonl); default: the demo prompts")
    p.add_argument("--max-model-len", type=positive, default=None,
                   help="engine context length for the latency probe (default: fits the prompts + --max-tokens)")
    p.add_argument("--repeats", type=positive, default=5, help="latency repeats per token count (median)")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="take the smallest K within this fraction of the best tokens/s (default 0.01)")
    p.add_argument("--acceptance", type=float_list, default=None,
                   help="skip the acceptance run: conditional acceptance by position, e.g. 0.8,0.7,0.6")
    p.add_argument("--latency-json", default=None,
                   help="skip the latency probe: a JSON object {token_count: seconds}")
    p.add_argument("--enforce-eager", action="store_true", help="measure without torch.compile")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the measurements and table as JSON")
    add_threads_flag(p)
    p.add_argument("--validate", action="store_true",
                   help="also measure real tokens/s against concurrency with K=0, K=max and the tuned "
                        "table (three more engines), printed and plotted next to the model's prediction")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot tokens/s against concurrency for each fixed K and the tuned table (needs matplotlib)")


def run(args) -> int:
    from npuspec.bench import tune  # heavy: keeps `--help` and flag errors off torch's import
    return tune.run(args)
