"""Train a drafter for a target model: EAGLE-3 (default), EAGLE, Medusa, MTP, DFlash or DSpark
(docs/train_draft.md).

    npuspec train-draft --target tiny --method eagle3 --out drafts/eagle3
    npuspec train-draft --target ~/models/Qwen3-0.6B --data /dev/shm/hs --out drafts/q3-eagle3
    npuspec train-draft --target tiny --method mtp --out /tmp/tiny-mtp   # a copy of the target + MTP layer
    npuspec train-draft --target tiny --method dflash --block-size 8 --out drafts/dflash

Without --data it makes its own data: the Python standard library's sources (the embedded
model's corpus, the same files held out), tokenized with the target's tokenizer and run through
the target. With --data DIR it reads extract_hidden_states files captured with layer ids
aux + [num_hidden_layers]. The output loads with
speculative_config={"method": METHOD, "model": OUT} (MTP: "model" is OUT, the target copy).
OUT/train_recipe.json records the run; OUT/train_state/ holds the resumable checkpoint.
"""
from __future__ import annotations

import argparse

from npuspec.cli_util.flags import add_threads_flag, positive

DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="tiny", help="target model: HF checkpoint directory, a .gguf "
                   "file, or 'tiny' (the embedded model)")
    p.add_argument("--method", default="eagle3",
                   choices=("eagle3", "eagle", "medusa", "mtp", "dflash", "dspark"))
    p.add_argument("--out", required=True, help="output directory (for mtp: a copy of the target "
                   "checkpoint, made from --target when OUT has no config.json)")
    p.add_argument("--data", default=None, metavar="DIR", help="extract_hidden_states .safetensors "
                   "files (default: generate data from the stdlib corpus with the target)")
    p.add_argument("--steps", type=positive, default=800)
    p.add_argument("--batch", type=positive, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=positive, default=128, help="training rows per sequence")
    p.add_argument("--lr", type=float, default=5e-3, help="peak AdamW learning rate (the default suits the "
                   "embedded model; ~1e-4 for billion-parameter targets)")
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps, then cosine to 10%%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttt-steps", type=positive, default=None,
                   help="training-time-test steps (default: 3 for eagle3, 1 for eagle and mtp)")
    p.add_argument("--draft-vocab-size", type=positive, default=None,
                   help="eagle3 draft vocabulary Vd: the Vd most frequent training tokens "
                        "(default: the target's vocab_size)")
    p.add_argument("--aux-layer-ids", default=None, metavar="I,J,K",
                   help="the target layers the draft reads (vLLM aux ids: the residual entering "
                        "layer i, L = the last one before the norm); eagle3 default 2,L//2,L-3; "
                        "dflash/dspark default z-lab's build_target_layer_ids + 1 for "
                        "--draft-layers")
    p.add_argument("--num-heads", type=positive, default=4, help="medusa heads")
    p.add_argument("--block-size", type=positive, default=None,
                   help="dflash/dspark query slots per block: dflash drafts block_size-1 tokens "
                        "per round, dspark block_size (default 16 for dflash, 7 for dspark)")
    p.add_argument("--draft-layers", type=positive, default=None,
                   help="dflash/dspark decoder layers (default 1)")
    p.add_argument("--num-anchors", type=positive, default=None,
                   help="dflash/dspark random blocks per training sequence (default 16)")
    p.add_argument("--gamma", type=float, default=None,
                   help="dflash/dspark position weights exp(-k/gamma) (default 4.0)")
    p.add_argument("--eval-anchors", type=positive, default=None,
                   help="dflash/dspark held-out blocks per eval sequence (default 8)")
    p.add_argument("--eval-every", type=int, default=100, help="held-out acceptance every N steps "
                   "(and at the end)")
    p.add_argument("--eval-k", type=positive, default=4, help="draft positions scored (medusa: "
                   "--num-heads; dflash/dspark: the whole block)")
    p.add_argument("--eval-batches", type=positive, default=4)
    p.add_argument("--save-every", type=int, default=100, help="checkpoint OUT/train_state every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="loss and acceptance curves "
                   "(needs matplotlib)")
    p.add_argument("--save-dtype", default="float32", choices=DTYPES,
                   help="dtype of the written draft weights")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N stdlib files "
                   "(0 = all; for quick runs)")
    p.add_argument("--distill", type=int, default=0, metavar="N",
                   help="self-distilled data: the target's greedy answers to N varied prompts "
                        "(npuspec.train.distill; none from the held-out open-ended set), kept "
                        "in OUT/distill.jsonl and mixed with Python's doc topics and the stdlib "
                        "corpus (0 = the stdlib corpus only)")
    p.add_argument("--distill-tokens", type=positive, default=256,
                   help="new tokens per self-distilled answer")
    p.add_argument("--distill-batch", type=positive, default=32,
                   help="requests the engine decodes at once while distilling")
    p.add_argument("--stop-after", type=int, default=0, help=argparse.SUPPRESS)
    add_threads_flag(p)


def run(args) -> int:
    from npuspec.cli import train_draft_run  # heavy: keeps `--help` and flag errors off torch's import
    return train_draft_run.run(args, _defaults())


def _defaults() -> dict:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return {a.dest: a.default for a in p._actions}
