"""`npuspec train-draft`'s run: data, training, the saved draft, its recipe (its flags and
documentation: npuspec/cli/train_draft.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import npuspec
from npuspec import train as td
from npuspec.train import distill
from npuspec.bench.plots import require_matplotlib
from npuspec.cli_util import common
from npuspec.cli_util.errors import UsageError
from npuspec.cli_util.prompts import chat_tokenizer
from npuspec.models import load_model, load_tokenizer
from npuspec.models.config import read_config
from npuspec.models.draft_config import default_aux_layer_ids, default_block_aux_ids
from npuspec.models.draft_loading import load_draft
from npuspec.models.loading import TINY_MODEL_DIR, tokenizer_fingerprint


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


def resume_command(args, parser_defaults: dict) -> str:
    """The command that finishes this run from its last checkpoint (written into every
    checkpoint: loading an unfinished run's directory quotes it)."""
    again = argparse.Namespace(**{**vars(args), "resume": True,
                                  "stop_after": parser_defaults.get("stop_after")})
    return _command_line(again, parser_defaults)


def _target_record(target_path: str, tcfg) -> dict:
    """config.json's "npuspec_target": what the head was trained for, checked at load."""
    tok = load_tokenizer(target_path)
    rec = {"name": os.path.basename(os.path.normpath(target_path)),
           "hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size,
           "rope_theta": tcfg.rope_theta}
    if tok is not None:
        rec["tokenizer_sha256"] = tokenizer_fingerprint(tok)
    return {"npuspec_target": rec}


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


def run(args, defaults: dict) -> int:
    """Train, save and check the draft; `defaults`: the parser's defaults (the recipe's command
    line lists only the flags that differ)."""
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
        sep = None if tok.token_to_id("<|endoftext|>") is not None else (eos[0] if eos else 0)
        corpus = td.stdlib_corpus(tok, args.max_files, sep_id=sep)
        if args.distill:
            corpus = _distilled(args, target_path, out, tok, corpus,
                                tok.token_to_id("<|endoftext|>") if sep is None else sep)
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
                       on_step=lambda n: bar.update(), stop_after=args.stop_after,
                       state_extra={"resume_command": resume_command(args, defaults)})
    dtype = getattr(torch, args.save_dtype)
    if args.stop_after and res.steps < cfg.steps:
        print(f"stopped after {res.steps} steps (--stop-after); resume with --resume", flush=True)
        return 0
    td.save_trained(res.module, out, dtype=dtype,
                    target_dir=target_path if os.path.isdir(target_path) else None,
                    extra_config=_target_record(target_path, tcfg))
    loaded = _check_load(args.method, out, tcfg, target, res.module, target_path)
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
        "command": _command_line(args, defaults),
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


def _distilled(args, target_path: str, out: str, tok, stdlib, sep: int):
    """--distill: the target's own answers (generated once, kept in OUT/distill.jsonl), with
    Python's doc topics and the stdlib corpus added to the training split; validation is on
    held-back answers only (the distribution the draft will serve)."""
    try:
        prompts = distill.distill_prompts(args.distill, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e), "--distill") from None
    chat = chat_tokenizer(target_path)
    settings = {"target_tokenizer": tokenizer_fingerprint(tok), "prompts": prompts,
                "max_tokens": args.distill_tokens, "chat_template": chat is not None}
    os.makedirs(out, exist_ok=True)
    head: dict = {}
    seqs = distill.load_or_generate(
        os.path.join(out, "distill.jsonl"), settings,
        lambda: distill.generate(target_path, prompts, args.distill_tokens, args.distill_batch,
                                 chat_tok=chat), header=head)
    docs = []
    for enc in tok.encode_batch(distill.pydoc_texts()):
        docs += enc.ids + [sep]
    extra = torch.cat([torch.tensor(docs, dtype=torch.int32), stdlib.train])
    info = {"prompts": len(prompts), "distill_tokens": args.distill_tokens,
            "chat_template": chat is not None,
            # how long generating the answers took (the run that made distill.jsonl)
            "distill_seconds": head.get("seconds"),
            "mixed_with": {"pydoc_topics_tokens": len(docs),
                           "stdlib": {k: stdlib.info[k] for k in ("train_files", "train_tokens")}}}
    return distill.distilled_corpus(seqs, sep, extra=extra, info=info)


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


def _check_load(method, out, tcfg, target, module, target_path) -> dict:
    """Read the written draft back with load_draft, as serving will."""
    d = load_draft(method, out, tcfg, target, target_dir=target_path)
    mine, theirs = module.state_dict(), d.state_dict()
    diff = max((float((mine[k].float() - theirs[k].float()).abs().max()) for k in mine
                if k in theirs and mine[k].is_floating_point()), default=0.0)
    missing = sorted(set(mine) - set(theirs))
    if missing:
        raise RuntimeError(f"load_draft({method!r}, {out!r}) lacks tensors {missing[:4]}")
    return {"loaded_with": "npuspec.models.draft_loading.load_draft",
            "format": d.config.format, "max_abs_diff": diff}
