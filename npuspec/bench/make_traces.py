"""Build the shipped proposer traces from the Python standard library's own sources.

    python -m npuspec.bench.make_traces [--seed 0] [--out DIR]

Offline and deterministic: the same seed and the same interpreter (its Lib/ files) give
byte-identical files. The shipped set was built with CPython 3.11.7 and seed 0.

Format (one JSON object per line):
    {"kind": "edit", "name": "...", "prompt": [ids], "response": [ids]}
Only "prompt" and "response" are required by the replayer; "kind"/"name" are labels.

Tokenizer ("words"): text is split by TOKEN_RE below (an identifier or number with at most one
leading space, a newline with the indentation after it, a run of spaces/tabs, or one other
character), which is lossless: "".join(tokens) == text. Ids are given in order of first
appearance over the whole build and saved in vocab.jsonl (line i = the JSON string of id i),
so `decode` can print any trace. Tokens average ~3 characters, close to a BPE tokenizer's.

Workloads (what each file exercises):
  edit.jsonl        prompt = an instruction + a source file chunk; response = the whole chunk
                    rewritten with edits (a rename, inserted comments, deleted lines, changed
                    numbers). Long copies from the prompt: the per-request tree / n-gram index.
  extract.jsonl     prompt = an instruction + a chunk; response = spans copied out of it (def
                    lines, imports, docstrings). Short copies with jumps.
  multisample.jsonl several responses per prompt (a function body, not in the prompt, written
                    with per-sample variations). Later samples reuse earlier ones: the global tree.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sysconfig

TOKEN_RE = re.compile(r" ?[A-Za-z_][A-Za-z0-9_]*| ?[0-9]+|\n[ \t]*| ?[^\sA-Za-z0-9_]|[ \t]+|.",
                      re.S)
TRACES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces")
TRACE_FILES = ("edit.jsonl", "extract.jsonl", "multisample.jsonl")


class Vocab:
    def __init__(self):
        self.ids: dict[str, int] = {}
        self.toks: list[str] = []

    def encode(self, text: str) -> list[int]:
        toks = TOKEN_RE.findall(text)
        assert "".join(toks) == text, "tokenizer must be lossless"
        out = []
        for t in toks:
            i = self.ids.get(t)
            if i is None:
                i = self.ids[t] = len(self.toks)
                self.toks.append(t)
            out.append(i)
        return out

    def decode(self, ids) -> str:
        return "".join(self.toks[i] for i in ids)


def _stdlib_files() -> list[str]:
    lib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(lib) if n.endswith(".py") and not n.startswith("_"))
    out = []
    for n in names:
        path = os.path.join(lib, n)
        size = os.path.getsize(path)
        if 6_000 <= size <= 200_000:
            out.append(path)
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().replace("\r\n", "\n")


def _chunk(text: str, rng: random.Random, max_chars: int) -> str:
    """A run of whole lines of at most max_chars characters, starting at a top-level line."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, l in enumerate(lines) if l[:1] not in (" ", "\t", "\n", "#", "")]
    i = rng.choice(starts[: max(1, len(starts) // 2)])
    out, n = [], 0
    for l in lines[i:]:
        if n + len(l) > max_chars:
            break
        out.append(l)
        n += len(l)
    return "".join(out)


# -- edits ------------------------------------------------------------------------------------
def _edit(text: str, rng: random.Random) -> tuple[str, str]:
    lines = text.splitlines(keepends=True)
    what = []
    idents = [w for w in re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", text)
              if w not in {"self", "return", "import", "from", "class", "None", "True", "False",
                           "def", "else", "elif", "while", "with", "pass", "raise", "yield"}]
    counts: dict[str, int] = {}
    for w in idents:
        counts[w] = counts.get(w, 0) + 1
    common = sorted(w for w, c in counts.items() if 3 <= c <= 40)
    if common:
        old = rng.choice(common)
        new = old + rng.choice(["_v2", "_new", "_impl", "_x"])
        lines = [re.sub(rf"\b{old}\b", new, l) for l in lines]
        what.append(f"rename {old} to {new}")
    out = []
    for l in lines:
        s = l.lstrip()
        ind = l[: len(l) - len(s)]
        r = rng.random()
        if s.startswith("def ") and r < 0.5:
            note = rng.choice(["TODO: add tests", "Checked", "Hot path", "Note: keep in sync"])
            out.append(f"{ind}# {note}\n")
            out.append(l)
        elif s and not s.startswith(("def ", "class ", "@")) and r < 0.03:
            continue  # deleted line
        elif re.search(r"\b\d+\b", l) and r < 0.3:
            out.append(re.sub(r"\b(\d+)\b", lambda m: str(int(m.group(1)) + 1), l, count=1))
        else:
            out.append(l)
    what.append("comment some functions, drop dead lines, bump constants")
    return "; ".join(what), "".join(out)


# -- extraction -------------------------------------------------------------------------------
def _extract(text: str, rng: random.Random) -> tuple[str, str]:
    lines = text.splitlines(keepends=True)
    kind = rng.choice(["def", "import", "doc", "class"])
    if kind == "def":
        got = [l.strip() + "\n" for l in lines if l.lstrip().startswith("def ")]
        ask = "List every function signature, one per line."
    elif kind == "import":
        got = [l.strip() + "\n" for l in lines if l.startswith(("import ", "from "))]
        ask = "List the import statements."
    elif kind == "class":
        got = [l.strip() + "\n" for l in lines if l.lstrip().startswith("class ")]
        ask = "List the class definitions."
    else:
        got = re.findall(r'"""(.*?)"""', text, re.S)
        got = [g.strip().split("\n\n")[0].strip() + "\n---\n" for g in got]
        ask = "Copy the first paragraph of every docstring, separated by ---."
    if not got:
        got = [l for l in lines[:20]]
        ask = "Copy the first 20 lines."
    return ask, "".join(got)


# -- multi-sample -----------------------------------------------------------------------------
def _functions(text: str) -> list[tuple[str, str]]:
    """(header, body) of top-level or method defs with a body of 8..60 lines."""
    lines = text.splitlines(keepends=True)
    out = []
    for i, l in enumerate(lines):
        s = l.lstrip()
        if not s.startswith("def "):
            continue
        ind = len(l) - len(s)
        j = i
        while j + 1 < len(lines) and not lines[j].rstrip().endswith(":") and j < i + 5:
            j += 1  # multi-line signature
        body = []
        for k in range(j + 1, len(lines)):
            t = lines[k]
            if t.strip() and len(t) - len(t.lstrip()) <= ind:
                break
            body.append(t)
        if 8 <= len(body) <= 60:
            out.append(("".join(lines[i:j + 1]), "".join(body)))
    return out


def _variant(body: str, rng: random.Random) -> str:
    lines = body.splitlines(keepends=True)
    names = sorted(set(re.findall(r"\b([a-z][a-z0-9]{0,7})\s*=[^=]", body)) - {"self"})
    if names and rng.random() < 0.6:
        old = rng.choice(names)
        new = rng.choice(["tmp", "value", "res", "item", "val", "obj"])
        lines = [re.sub(rf"\b{old}\b", new, l) for l in lines]
    out = []
    for l in lines:
        r = rng.random()
        if r < 0.05 and l.strip():
            continue
        if r > 0.96 and l.strip():
            ind = l[: len(l) - len(l.lstrip())]
            note = rng.choice(["edge case", "fast path", "see above", "keep order"])
            out.append(f"{ind}# {note}\n")
        out.append(l)
    return "".join(out)


def build(seed: int = 0, out_dir: str = TRACES_DIR, n_edit: int = 12, n_extract: int = 16,
          n_groups: int = 12, samples: int = 4) -> dict[str, int]:
    rng = random.Random(seed)
    files = _stdlib_files()
    vocab = Vocab()
    traces: dict[str, list[dict]] = {name: [] for name in TRACE_FILES}

    for i, path in enumerate(rng.sample(files, n_edit)):
        chunk = _chunk(_read(path), rng, rng.randint(8_000, 15_000))
        how, edited = _edit(chunk, rng)
        prompt = f"Apply these edits ({how}) and return the whole file.\n\n{chunk}\n"
        traces["edit.jsonl"].append(dict(
            kind="edit", name=os.path.basename(path),
            prompt=vocab.encode(prompt), response=vocab.encode(edited)))

    for path in rng.sample(files, n_extract):
        chunk = _chunk(_read(path), rng, rng.randint(3_000, 9_000))
        ask, got = _extract(chunk, rng)
        prompt = f"{ask}\n\n{chunk}\n"
        traces["extract.jsonl"].append(dict(
            kind="extract", name=os.path.basename(path),
            prompt=vocab.encode(prompt), response=vocab.encode(got)))

    groups = 0
    for path in rng.sample(files, len(files)):
        if groups == n_groups:
            break
        funcs = _functions(_read(path))
        if not funcs:
            continue
        header, body = rng.choice(funcs)
        groups += 1
        for s in range(samples):
            prompt = (f"Sample {s + 1} of {samples}. Write the body of this function from "
                      f"{os.path.basename(path)}:\n\n{header}")
            traces["multisample.jsonl"].append(dict(
                kind="multisample", name=f"{os.path.basename(path)}#{s}",
                prompt=vocab.encode(prompt), response=vocab.encode(_variant(body, rng))))

    os.makedirs(out_dir, exist_ok=True)
    sizes = {}
    for name, rows in traces.items():
        p = os.path.join(out_dir, name)
        with open(p, "w") as f:
            for r in rows:
                f.write(json.dumps(r, separators=(",", ":")) + "\n")
        sizes[name] = os.path.getsize(p)
    p = os.path.join(out_dir, "vocab.jsonl")
    with open(p, "w") as f:
        for t in vocab.toks:
            f.write(json.dumps(t) + "\n")
    sizes["vocab.jsonl"] = os.path.getsize(p)
    return sizes


def load_vocab(path: str = os.path.join(TRACES_DIR, "vocab.jsonl")) -> Vocab:
    v = Vocab()
    with open(path) as f:
        for line in f:
            t = json.loads(line)
            v.ids[t] = len(v.toks)
            v.toks.append(t)
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=TRACES_DIR, help="output directory (default: the package's)")
    args = ap.parse_args(argv)
    sizes = build(args.seed, args.out)
    for name, size in sizes.items():
        print(f"{os.path.join(args.out, name)}: {size / 1024:.0f} KiB")
    print(f"total: {sum(sizes.values()) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
