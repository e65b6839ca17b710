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
import json
import os
import sys
import time

import torch

import npuspec
from npuspec import train as td
from npuspec.bench.plots import require_matplotlib
from npuspec.cli_util import common
from npuspec.cli_util.common import add_threads_flag, positive
from npuspec.cli_util.errors import UsageError
from npuspec.models import load_model, load_tokenizer
from npuspec.models.config import read_config
from npuspec.models.draft_config import default_aux_layer_ids, default_block_aux_ids
from npuspec.models.draft_loading import load_draft
from npuspec.models.loading import TINY_MODEL_DIR

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
    p.add_argument("--stop-after", type=int, default=0, help=argparse.SUPPRESS)
    add_threads_flag(p)


def _ids(s: str | None, L: int, default: tuple):
    if s is None:
        return default
    try:
        ids = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        ids = ()
    if not ids or not all(0 <= i <= L for i in ids):
        raise UsageError(f"{s!r} must be comma-separated layer ids in 0..{L}, e.g. "
                         f"{','.join(map(str, default))}", "--aux-layer-ids")
    return ids


def _aux_ids(args, L: int) -> tuple:
    """The aux layers the method reads: none for eagle, medusa, mtp (the final hidden)."""
    if args.method == "eagle3":
        return _ids(args.aux_layer_ids, L, default_aux_layer_ids(L))
    if args.method in ("dflash", "dspark"):
        return _ids(args.aux_layer_ids, L, default_block_aux_ids(L, args.draft_layers or 1))
    if args.aux_layer_ids is not None:
        raise UsageError(f"{args.method} reads the target's final hidden state, not aux layers; "
                         "drop --aux-layer-ids (it applies to eagle3, dflash, dspark)",
                         "--aux-layer-ids")
    return ()


def repo_relative(path: str) -> str:
    """`path` relative to the npuspec checkout when it lies inside it (recipes shipped in the
    package must not name the machine they were made on), else unchanged."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(npuspec.__file__)))
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.commonpath([root, full]) == root:
        return os.path.relpath(full, root)
    return path


def _command_line(args, parser_defaults: dict) -> str:
    parts = ["npuspec", "train-draft"]
    for k, v in vars(args).items():
        if k in ("run", "command", "debug") or (v == parser_defaults.get(k)
                                                 and k not in ("target", "method")):
            continue
        flag = "--" + k.replace("_", "-")
        parts += [flag] if v is True else [flag, str(v)]
    return " ".join(parts)


def plot_training(path: str, history: dict, method: str) -> None:
    """Training loss per step and held-out acceptance per position (+ expected length)."""
    plt = require_matplotlib()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(history["step"], history["loss"], lw=0.8, color="tab:blue", alpha=0.5)
    n = max(1, len(history["loss"]) // 30)
    if n > 1:
        sm = [sum(history["loss"][max(0, i - n + 1):i + 1]) / len(history["loss"][max(0, i - n + 1):i + 1])
              for i in range(len(history["loss"]))]
        ax.plot(history["step"], sm, lw=1.8, color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{method}: loss")
    ax.grid(alpha=0.3)
    ev = history["eval"]
    if ev:
        steps = [e["step"] for e in ev]
        K = len(ev[0]["acceptance"])
        for k in range(K):
            ax2.plot(steps, [e["acceptance"][k] for e in ev], marker="o", ms=3, label=f"position {k + 1}")
        ax2.set_ylim(0, 1.0)
        ax2.set_ylabel("held-out top-1 agreement")
        ax3 = ax2.twinx()
        ax3.plot(steps, [e["acceptance_length"] for e in ev], "k--", lw=1.5, label="expected length")
        ax3.set_ylabel("expected acceptance length")
        ax3.set_ylim(1.0, K + 1.0)
        ax2.legend(loc="upper left", fontsize=8)
        ax3.legend(loc="lower right", fontsize=8)
    ax2.set_xlabel("step")
    ax2.set_title("held-out acceptance")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    t_wall = time.time()
    if args.plot:
        require_matplotlib("--plot")  # fail before training, not after
    target_path = common.model_dir(args.target, "--target")
    threads = common.set_threads(args.threads, target_path)
    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.realpath(out) == os.path.realpath(TINY_MODEL_DIR):
        raise UsageError("refusing to write into the installed embedded model; pass a copy "
                         "(the MTP layer is added to a copy of the target)", "--out")
    tcfg, target = load_model(target_path)
    if args.method == "mtp":
        _check_mtp_out(out, target_path, tcfg)
    aux = _aux_ids(args, tcfg.num_layers)
    block = {k: getattr(args, k) for k in ("block_size", "num_anchors", "draft_layers", "gamma",
                                           "eval_anchors")}
    if args.method not in ("dflash", "dspark"):
        given = [k for k, v in block.items() if v is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(f"{block[given[0]]} was given, but it applies to --method dflash "
                             f"or dspark only; drop it for {args.method}", flag)
        block = {}
    try:
        cfg = td.TrainConfig(method=args.method, steps=args.steps, batch=args.batch,
                             seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, seed=args.seed,
                             ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
                             num_heads=args.num_heads, eval_every=args.eval_every,
                             eval_k=args.eval_k, eval_batches=args.eval_batches,
                             save_every=args.save_every, **block)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.draft_vocab_size and cfg.draft_vocab_size > tcfg.vocab_size:
        raise UsageError(f"{cfg.draft_vocab_size} exceeds the target's vocab_size "
                         f"{tcfg.vocab_size}", "--draft-vocab-size")
    t0 = time.time()
    if args.data:
        if not os.path.isdir(args.data):
            raise UsageError(f"{args.data!r} is not a directory of hidden states files", "--data")
        data = td.FileData(target, td.hidden_state_files(args.data), n_aux=len(aux))
    else:
        tok = load_tokenizer(target_path)
        if tok is None:
            raise UsageError(f"{args.target} has no tokenizer.json, so train-draft cannot make its "
                             "own data; capture extract_hidden_states files and pass --data",
                             "--target")
        eos = tcfg.eos_token_ids
        corpus = td.stdlib_corpus(tok, args.max_files, sep_id=None if tok.token_to_id(
            "<|endoftext|>") is not None else (eos[0] if eos else 0))
        data = td.CorpusData(target, corpus.train, corpus.val, aux, corpus.info)
    print(f"train-draft {args.method}: target {target_path} ({tcfg.num_layers} layers, hidden "
          f"{tcfg.hidden_size}, vocab {tcfg.vocab_size}), data {json.dumps(data.info)[:300]} "
          f"({time.time() - t0:.0f}s), {cfg.steps} steps of {cfg.batch}x{cfg.seq_len}, "
          f"{threads} thread(s)", flush=True)

    state_dir = os.path.join(out, "train_state")
    with common.Progress(f"train-draft {args.method}", cfg.steps) as bar:
        if args.resume and os.path.isfile(os.path.join(state_dir, "state.json")):
            with open(os.path.join(state_dir, "state.json")) as f:
                bar.update(json.load(f).get("step", 0))
        res = td.train(target, data, cfg, state_dir, resume=args.resume, aux_ids=aux or None,
                       log=lambda s: print(("\n" if bar.enabled else "") + s, flush=True),
                       on_step=lambda n: bar.update(), stop_after=args.stop_after)
    dtype = getattr(torch, args.save_dtype)
    if args.stop_after and res.steps < cfg.steps:
        print(f"stopped after {res.steps} steps (--stop-after); resume with --resume", flush=True)
        return 0
    td.save_trained(res.module, out, dtype=dtype,
                    target_dir=target_path if os.path.isdir(target_path) else None)
    loaded = _check_load(args.method, out, tcfg, target, res.module)
    block = args.method in ("dflash", "dspark")
    if block:
        definition = ("as serving verifies: each held-out anchor's block drafted greedily, the "
                      "target's greedy tokens after [prefix, drafts]; a_k = P(drafts 1..k all "
                      "accepted); 1 + sum_k a_k")
    else:
        definition = ("teacher-forced top-1 agreement with the target's argmax per draft "
                      "position; 1 + sum_k prod_{i<=k} a_i")
    heldout = {"per_position": [round(a, 4) for a in res.acceptance],
               "expected_acceptance_length": round(res.acceptance_length, 4),
               "definition": definition}
    if block and res.history["eval"]:
        last = res.history["eval"][-1]
        heldout.update({k: last[k] for k in ("anchors", "conditional_acceptance",
                                             "mean_confidence") if k in last})
    recipe = {
        "command": _command_line(args, _defaults()),
        "argv": [os.path.basename(sys.argv[0])] + [repo_relative(a) if os.path.exists(a) else a
                                                  for a in sys.argv[1:]],
        "args": {k: v for k, v in vars(args).items() if k not in ("run",)},
        "method": args.method, "target": repo_relative(target_path), "seed": cfg.seed,
        "train_config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "aux_layer_ids": list(aux), "data": data.info, "steps": res.steps,
        "train_seconds": round(res.train_seconds, 1), "wall_seconds": round(time.time() - t_wall, 1),
        "final_loss": round(res.final_loss, 5),
        "heldout_acceptance": heldout,
        "saved_dtype": args.save_dtype, "load_check": loaded,
        "speculative_config": {"method": args.method, "model": repo_relative(out),
                               "num_speculative_tokens": cfg.num_heads if args.method == "medusa"
                               else cfg.positions if block else cfg.eval_k},
        "torch": torch.__version__, "python": sys.version.split()[0], "threads": threads,
    }
    path = os.path.join(out, "train_recipe.json")
    with open(path, "w") as f:
        json.dump(recipe, f, indent=2)
        f.write("\n")
    os.chmod(path, 0o644)
    if args.plot:
        plot_training(args.plot, res.history, args.method)
    acc = " ".join(f"{a:.3f}" for a in res.acceptance)
    print(f"wrote {out} ({args.method}, {res.steps} steps in {res.train_seconds:.0f}s): held-out "
          f"acceptance by position {acc}, expected acceptance length "
          f"{res.acceptance_length:.3f}; load with speculative_config="
          f"{json.dumps(recipe['speculative_config'])}", flush=True)
    return 0


def _defaults() -> dict:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return {a.dest: a.default for a in p._actions}


def _check_mtp_out(out: str, target_path: str, tcfg) -> None:
    if os.path.isfile(os.path.join(out, "config.json")):
        oc = read_config(out)
        if (oc.hidden_size, oc.num_layers, oc.vocab_size) != (tcfg.hidden_size, tcfg.num_layers,
                                                              tcfg.vocab_size):
            raise UsageError(f"{out} holds another model (hidden {oc.hidden_size}, "
                             f"{oc.num_layers} layers, vocab {oc.vocab_size}); for mtp, --out is "
                             "a copy of the target checkpoint", "--out")
    elif not os.path.isdir(target_path):
        raise UsageError("the MTP layer is written into an HF copy of the target, and --target "
                         "is a GGUF file; pass --out an HF directory of the same model", "--out")


def _check_load(method, out, tcfg, target, module) -> dict:
    """Read the written draft back with load_draft, as serving will."""
    d = load_draft(method, out, tcfg, target)
    mine, theirs = module.state_dict(), d.state_dict()
    diff = max((float((mine[k].float() - theirs[k].float()).abs().max()) for k in mine
                if k in theirs and mine[k].is_floating_point()), default=0.0)
    missing = sorted(set(mine) - set(theirs))
    if missing:
        raise RuntimeError(f"load_draft({method!r}, {out!r}) lacks tensors {missing[:4]}")
    return {"loaded_with": "npuspec.models.draft_loading.load_draft",
            "format": d.config.format, "max_abs_diff": diff}
