"""A chain head's teacher-forced agreement on the target's own answers to a prompt set.

    npuspec bench heads --model SMOLLM2.gguf --head smollm2-eagle3 --prompts open-ended

The target answers each prompt greedily (npuspec's engine, `--max-tokens` new tokens); then
the head runs its training-time dense forward over prompt + answer (npuspec.train.chain, the
forward `tests/train/test_serving_matches_training.py` checks against serving) and each answer
position is scored: a_k = P(the head's k-th draft, given the gold prefix, equals the target's
greedy token). This is train-draft's held-out measure, taken on the prompts a benchmark
serves. So when served acceptance (`npuspec bench methods`) is far below the a_k training
printed, this bench says whether the gap is the text (a_k low here too) or the serving path
(a_k high here, served low).
"""
from __future__ import annotations

import argparse

import torch

from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.prompts import load_prompts
from npuspec.models.draft_loading import load_draft
from npuspec.models.loading import load_model
from npuspec.spec_decode.heads import resolve_draft
from npuspec.train.chain import ChainObjective
from npuspec.train.config import TrainConfig
from npuspec.train.data import Batch, _target_split
from npuspec.train.trainer import expected_acceptance_length

CHAIN_METHODS = ("eagle3", "eagle", "mtp", "medusa")


def answers(model: str, prompts: list[str], max_tokens: int, batch: int,
            **llm_kwargs) -> list[tuple[list, int]]:
    """[(prompt ids + answer ids, prompt length)] from the engine's greedy decoding."""
    from npuspec import LLM, SamplingParams
    llm = LLM(model, max_num_seqs=batch,
              max_model_len=common.fit_max_model_len(model, prompts, max_tokens), **llm_kwargs)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    finally:
        llm.shutdown()
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outs]


def agreement(head, target, seqs: list[tuple[list, int]], K: int) -> list[float]:
    """a_1..a_K over the answer positions of `seqs` (prompt tokens are context, not scored)."""
    obj = ChainObjective(head, target, TrainConfig(method=head.method, eval_k=K))
    aux = tuple(getattr(head, "aux_layer_ids", ()) or ())
    hits, counts = [0] * K, [0] * K
    for ids, n_prompt in seqs:
        x = torch.tensor([ids])                                        # [1, N]
        logits, final, feats = _target_split(target, aux, x)
        mask = torch.ones_like(x, dtype=torch.bool)
        mask[0, :n_prompt] = False  # rows scored: answer tokens after the first (prefill's, not drafted)
        h, c = obj.agreement(Batch(x, mask, final, logits, feats), K)
        hits = [a + b for a, b in zip(hits, h)]
        counts = [a + b for a, b in zip(counts, c)]
    return [a / c if c else 0.0 for a, c in zip(hits, counts)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="npuspec bench heads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="the target (tiny, an HF directory, a .gguf)")
    ap.add_argument("--head", required=True,
                    help="the head: a shipped name (smollm2-eagle3, tiny-eagle3, ...) or a directory")
    ap.add_argument("--method", default="eagle3", choices=CHAIN_METHODS)
    ap.add_argument("--prompts", default="open-ended,code-edit",
                    help="comma-separated prompt sets: built-in names (open-ended, code-edit) "
                         "or files (.txt, .json, .jsonl), as `bench methods` takes them")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="draft positions scored")
    ap.add_argument("--batch", type=int, default=24, help="requests the engine answers at once")
    common.add_threads_flag(ap)
    args = ap.parse_args(argv)
    if args.k < 1:
        ap.error(f"--k {args.k}: score at least one draft position")
    mdir = common.model_dir(args.model)
    sets = {s: load_prompts(s, model=mdir) for s in args.prompts.split(",") if s}
    common.set_threads(args.threads, mdir)
    cfg, target = load_model(mdir)
    head = load_draft(args.method, resolve_draft(args.head), cfg, target, target_dir=mdir).float()
    rows = []
    for s, prompts in sets.items():
        seqs = answers(mdir, prompts, args.max_tokens, args.batch)
        acc = agreement(head, target, seqs, args.k)
        rows.append({"prompts": s, "answers": len(seqs),
                     "tokens": sum(len(i) - n for i, n in seqs),
                     **{f"a_{k + 1}": round(a, 3) for k, a in enumerate(acc)},
                     "expected length": round(expected_acceptance_length(acc), 2)})
    print_table(rows, title=f"{args.head}: teacher-forced agreement on the target's greedy answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
