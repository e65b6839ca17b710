"""Train npuspec's embedded demo model on the Python standard library's own sources.

    python -m npuspec.models.train_tiny --out npuspec/models/tiny            # the shipped run
    python -m npuspec.models.train_tiny --out /tmp/tiny --steps 50           # a quick smoke run

What it does, deterministically for a given --seed and Python version (the corpus is the
stdlib of the interpreter that runs it, so another Python version gives other text):
  1. collects every `*.py` under sysconfig's stdlib directory, sorted, skipping test suites
     (test/, tests/, idle_test/) and site-packages; the last 2% of files are held out;
  2. trains a byte-level BPE tokenizer (`tokenizers`, --vocab-size tokens incl. one
     `<|endoftext|>` special token that separates files and is bos/eos);
  3. trains a small Llama-architecture DecoderLM (tied embeddings, GQA) on random windows
     of --seq-len tokens with AdamW and a warmup + cosine learning-rate schedule, CPU only;
  4. writes an HF-format checkpoint: config.json, model.safetensors (stored in float16 to
     stay well under 10 MB; both npuspec and transformers upcast it on load),
     tokenizer.json, and samples.txt with greedy continuations of a few code prompts.

This is a toy for demos and tests of speculative decoding: it continues Python-looking
code, it does not follow instructions, answer questions or write correct programs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time

import torch

from npuspec.models.config import ModelConfig
from npuspec.models.decoder import DecoderLM
from npuspec.models.loading import load_model, save_model

EOT = "<|endoftext|>"
SAMPLE_PROMPTS = ["def __init__(self", "import os\n", "for i in range(", "class Queue:\n",
                  "    def __repr__(self):\n        return"]
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise SystemExit(f"no *.py files under {root}: this Python has no stdlib sources to train on")
    return sorted(files)


def read_texts(files: list[str]) -> list[str]:
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_corpus(tok, texts: list[str]) -> torch.Tensor:
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int16 if tok.get_vocab_size() < 2**15 else torch.int32)


def batches(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)  # [B, T+1]
        chunk = data[idx].long()
        yield chunk[:, :-1], chunk[:, 1:]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


@torch.no_grad()
def evaluate(model: DecoderLM, data: torch.Tensor, seq_len: int, n: int = 16) -> float:
    gen = torch.Generator().manual_seed(1234)
    x, y = next(batches(data, n, seq_len, gen))
    logits = model.forward_causal(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


@torch.no_grad()
def greedy(model: DecoderLM, tok, prompt: str, max_new: int) -> str:
    ids = tok.encode(prompt).ids
    cache = model.allocate_cache(1, len(ids) + max_new)
    slot = torch.zeros(1, dtype=torch.long)
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], slot, cache)
    out, eot = [], tok.token_to_id(EOT)
    for _ in range(max_new):
        nxt = int(logits[0, -1].argmax())
        if nxt == eot:
            break
        out.append(nxt)
        pos = len(ids) + len(out) - 1
        logits = model(torch.tensor([[nxt]]), torch.tensor([[pos]]), slot, cache)
    return prompt + tok.decode(out)


def save(model: DecoderLM, cfg: ModelConfig, tok, out_dir: str, meta: dict):
    # Weights are stored fp16 for size; the config says compute in fp32.
    save_model(model, out_dir, tok, dtype=torch.float16,
               extra_config={"dtype": "float32", "npuspec_training": meta})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (HF format)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: on a shared machine oversubscribed OpenMP is several times slower)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=100, help="write a checkpoint every N steps (0: only at the end)")
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop after N steps of the --steps schedule (0: run all); reproduces an intermediate checkpoint")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N files (0 = all; for smoke runs)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    files = stdlib_files()
    if args.max_files:
        files = files[:args.max_files]
    n_val = max(1, len(files) // 50)
    train_texts, val_texts = read_texts(files[:-n_val]), read_texts(files[-n_val:])
    tok = train_tokenizer(train_texts, args.vocab_size)
    train, val = encode_corpus(tok, train_texts), encode_corpus(tok, val_texts)
    eot = tok.token_to_id(EOT)
    print(f"corpus: {len(files)} files from {sysconfig.get_paths()['stdlib']}, {len(train)} train / "
          f"{len(val)} val tokens, vocab {tok.get_vocab_size()}, prep {time.time() - t0:.1f}s", flush=True)

    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=args.hidden, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                      intermediate_size=args.intermediate, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      eos_token_id=eot, bos_token_id=eot, model_type="llama")
    model = DecoderLM(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
            if name.endswith(("wo.weight", "w2.weight")):  # scaled residual init (GPT-2)
                p.data.mul_(1 / math.sqrt(2 * cfg.num_layers))
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train, args.batch, args.seq_len, gen)
    print(f"model: {n_params / 1e6:.2f}M params, {args.steps} steps of {args.batch}x{args.seq_len} tokens", flush=True)

    t_train = time.time()
    last = min(args.steps, args.stop_after or args.steps)
    for step in range(last):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x, y = next(data)
        logits = model.forward_causal(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == last - 1:
            el = time.time() - t_train
            print(f"step {step:5d} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{(step + 1) * args.batch * args.seq_len / el:.0f} tok/s {el:.0f}s", flush=True)
        if step + 1 == last or (args.save_every and (step + 1) % args.save_every == 0):
            checkpoint(model, cfg, tok, val, args, step + 1, len(train), time.time() - t_train)
    print(f"wrote {args.out} in {time.time() - t0:.0f}s", flush=True)


def checkpoint(model, cfg, tok, val, args, steps_done, train_tokens, seconds):
    """Save an HF checkpoint after `steps_done` steps, then sample from the saved weights."""
    model.eval()
    val_loss = evaluate(model, val, args.seq_len)
    model.train()
    meta = {"script": "python -m npuspec.models.train_tiny",
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "save_every")},
            "steps_done": steps_done, "python": sys.version.split()[0], "torch": torch.__version__,
            "train_tokens": train_tokens, "val_loss": round(val_loss, 4), "train_seconds": round(seconds)}
    save(model, cfg, tok, args.out, meta)
    # samples come from the saved (fp16-rounded) weights, i.e. exactly what ships
    _, shipped = load_model(args.out)
    samples = [greedy(shipped, tok, p, 64) for p in SAMPLE_PROMPTS]
    with open(os.path.join(args.out, "samples.txt"), "w") as f:
        for s in samples:
            f.write(s + "\n" + "-" * 40 + "\n")
    print(f"checkpoint after {steps_done} steps: val loss {val_loss:.3f}", flush=True)
    for s in samples:
        print(s, "\n" + "-" * 40, flush=True)


if __name__ == "__main__":
    main()
