"""Self-distilled training data: the target's own greedy answers to a varied prompt set.

EAGLE-3, HASS and SpecForge train drafters on what the target itself says, not on text it
never wrote: a draft learns to predict the target's next token, and on the target's own
outputs those are the tokens it will be asked for. The answers come from npuspec's engine at a
large batch (greedy, so one run reproduces them), and are mixed with offline English text
(Python's documentation topics, `pydoc_data.topics`) and the stdlib corpus (data.py).

    prompts = distill_prompts(512, seed=0)     # templated requests, none of the held-out set
    seqs = generate(model, prompts, max_tokens=256, batch=32)   # prompt + answer token ids
    corpus = distilled_corpus(seqs, sep_id, extra=[...])        # -> data.Corpus

The prompts cover the held-out open-ended set's kinds (explanations, stories, advice,
how-tos, recipes, comparisons), facts, letters and code, from our own subject lists
(distill_subjects.py) and Python's topic and module names; any prompt equal to or containing a
held-out one is dropped (the held-out set is npuspec/bench/traces/open_ended.jsonl, measured
by `npuspec bench methods --prompts open-ended`). `load_or_generate` keeps the answers in
OUT/distill.jsonl, keyed by their settings, so a resumed or repeated run does not generate them
again.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from typing import Callable, Optional, Sequence

import torch

from npuspec.cli_util.prompts import apply_template, open_ended_requests
from npuspec.train.data import Corpus
from npuspec.train.distill_subjects import SUBJECTS

# (kind, template): {s} is a subject from the kind's list
TEMPLATES = {
    "explain": ["Explain {s} in simple terms.", "What is {s}, and why does it matter?",
                "Give a short explanation of {s} for a beginner."],
    "story": ["Write a short story about {s}.", "Tell a brief bedtime story involving {s}.",
              "Write a few paragraphs of a story that starts with {s}."],
    "advice": ["What advice would you give someone who wants to {s}?",
               "I am trying to {s}. What should I keep in mind?"],
    "howto": ["How do I {s}? Give step-by-step instructions.", "Explain how to {s}."],
    "recipe": ["Give me a simple recipe for {s}.", "How do I cook {s} at home?"],
    "compare": ["Compare {s}.", "What are the differences between {s}?"],
    "facts": ["Tell me some interesting facts about {s}.", "Describe {s} in a few paragraphs."],
    "letter": ["Write a short, polite email to {s}.", "Write a friendly letter to {s}."],
    "python": ["Explain the Python topic '{s}' with a small example.",
               "What does the Python standard library module {s} do? Show a short example."],
}


def _python_subjects() -> list[str]:
    import sys

    import pydoc_data.topics as topics
    return sorted(topics.topics) + sorted(m for m in sys.stdlib_module_names
                                          if not m.startswith("_"))[:120]


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def distill_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct requests, drawn round-robin over the kinds (seeded), none equal to or
    containing a held-out open-ended prompt (nor contained in one)."""
    held = [_norm(r["prompt"]) for r in open_ended_requests()]
    rng = random.Random(seed)
    pools = {}
    for kind, templates in TEMPLATES.items():
        subjects = _python_subjects() if kind == "python" else SUBJECTS[kind]
        pool = [t.format(s=s) for t in templates for s in subjects]
        rng.shuffle(pool)
        pools[kind] = [p for p in pool
                       if not any(h in _norm(p) or _norm(p) in h for h in held)]
    total = sum(len(p) for p in pools.values())
    if n > total:
        raise ValueError(f"distill_prompts: n={n} exceeds the {total} distinct prompts the "
                         f"templates make; use at most {total}")
    out: list[str] = []
    kinds = list(pools)
    while len(out) < n:
        for k in kinds:
            if pools[k] and len(out) < n:
                out.append(pools[k].pop())
    return out


def generate(model: str, prompts: Sequence[str], max_tokens: int, batch: int,
             chat_tok=None, llm_kwargs: Optional[dict] = None,
             log: Callable[[str], None] = print) -> list[list[int]]:
    """The target's greedy answers through npuspec's engine: [prompt ids + answer ids] per
    prompt. `chat_tok`: a transformers tokenizer with a chat template (cli_util.prompts.
    chat_tokenizer), which the prompts are rendered with first; None sends them as they are.
    `llm_kwargs`: more LLM(...) arguments (the default engine compiles its step)."""
    # the engine (Dynamo, the runner, ...) only when data is generated, not for training
    from npuspec import LLM, SamplingParams
    texts = (apply_template(chat_tok, [[{"role": "user", "content": p}] for p in prompts])
             if chat_tok is not None else list(prompts))
    llm = LLM(model, max_num_seqs=batch, max_model_len=max(512, 2 * max_tokens + 256),
              **(llm_kwargs or {}))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs, t0 = [], time.time()
    chunk = 8 * batch  # a progress line per chunk; each chunk still decodes `batch` at a time
    try:
        for i in range(0, len(texts), chunk):
            outs += llm.generate(texts[i:i + chunk], params)
            log(f"self-distilled data: {len(outs)}/{len(texts)} answers, "
                f"{time.time() - t0:.0f} s")
    finally:
        llm.shutdown()
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def _settings_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def load_or_generate(path: str, settings: dict, make: Callable[[], list[list[int]]],
                     log: Callable[[str], None] = print,
                     header: Optional[dict] = None) -> list[list[int]]:
    """The sequences stored at `path` (JSON lines: a header with `settings` and the seconds
    `make()` took, then one {"ids": [...]} per prompt) when they were made with the same
    settings, else `make()`'s, written there first (atomically). `header`, when given, gets
    the stored header's entries (`seconds`: how long generating them took)."""
    key = _settings_key(settings)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            head = json.loads(f.readline() or "{}")
            if head.get("key") == key:
                seqs = [json.loads(line)["ids"] for line in f if line.strip()]
                log(f"self-distilled data: {len(seqs)} answers read from {path}")
                if header is not None:
                    header.update(head)
                return seqs
        log(f"self-distilled data: {path} was made with other settings; generating again")
    t0 = time.time()
    seqs = make()
    head = {"key": key, "settings": settings, "seconds": round(time.time() - t0, 1)}
    if header is not None:
        header.update(head)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(head) + "\n")
        for s in seqs:
            f.write(json.dumps({"ids": s}) + "\n")
    os.replace(tmp, path)
    return seqs


def distilled_corpus(seqs: list[list[int]], sep_id: int, extra: Optional[torch.Tensor] = None,
                     val_share: float = 0.02, info: Optional[dict] = None):
    """A data.Corpus from the sequences, each followed by `sep_id`: `val_share` of them (at
    least one, evenly spaced, the last included) are its validation split; `extra` (token
    ids, e.g. the stdlib corpus's training stream) is appended to the training split."""
    if len(seqs) < 2:
        raise ValueError(f"self-distilled data: {len(seqs)} sequence(s); at least 2 are needed "
                         f"(one held out for validation)")
    n_val = max(1, int(len(seqs) * val_share))
    # every step-th sequence, ending with the last: the prompts come round-robin over the
    # kinds, so the validation split covers the kinds as the training split does (the tail
    # alone would be the kinds with the most subjects)
    step = len(seqs) // n_val
    val_idx = set(range(len(seqs) - 1, -1, -step)[:n_val])

    def stream(ss):
        ids = []
        for s in ss:
            ids += s + [sep_id]
        return torch.tensor(ids, dtype=torch.int32)

    train = stream([s for i, s in enumerate(seqs) if i not in val_idx])
    val = stream([s for i, s in enumerate(seqs) if i in val_idx])
    distilled_tokens = int(train.numel())
    if extra is not None and extra.numel():
        train = torch.cat([train, extra.to(torch.int32)])
    meta = {"source": "self-distill", "sequences": len(seqs), "val_sequences": n_val,
            "distilled_train_tokens": distilled_tokens, "train_tokens": int(train.numel()),
            "val_tokens": int(val.numel()), **(info or {})}
    return Corpus(train, val, meta)


def pydoc_texts() -> list[str]:
    """Python's documentation topics (offline English prose with code)."""
    import pydoc_data.topics as topics
    return [topics.topics[k] for k in sorted(topics.topics)]
