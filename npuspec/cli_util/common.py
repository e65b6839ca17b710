"""Argument checks shared by every command line (the CLI's subcommands, the server, the benches,
train-draft), each turning a bad value into a UsageError that names the flag; the default
speculative configs; and a progress bar that only draws on a terminal. The parts that build
flags (argparse types, --threads, the default configs) live in flags.py, which imports no torch,
and are re-exported here."""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from npuspec.cli_util.errors import UsageError, with_field
from npuspec.cli_util.flags import (DEFAULT_SPEC, METHOD_SPECS, SPEC_FLAG, add_threads_flag,  # noqa: F401
                                    finite, float_list, int_list, positive)
from npuspec.config import SpeculativeConfig
from npuspec.models.gguf import find_gguf, is_gguf_path
from npuspec.models.loading import TINY_MODEL_DIR, load_tokenizer, read_model_config


def spec_dict(value: str | dict | None, field: str = SPEC_FLAG) -> dict | None:
    """`--speculative-config` as a dict: inline JSON (vllm serve's schema) or a path to a .json
    file; 'none' or '' mean no speculation."""
    if value is None or isinstance(value, dict):
        return value
    text = value.strip()
    if text.lower() in ("", "none", "null", "off"):
        return None
    if not text.startswith("{") and os.path.isfile(os.path.expanduser(text)):
        with open(os.path.expanduser(text), encoding="utf-8") as f:
            text = f.read()
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"not valid JSON ({e.msg} at column {e.colno} of {value!r}); write it like "
                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}' (single quotes "
                         f"around the JSON in a shell)", field) from None
    if d is None:
        return None
    if not isinstance(d, dict):
        raise UsageError(f"must be a JSON object, got {type(d).__name__} {d!r}; e.g. "
                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'", field)
    return d


def spec_config(value, field: str = SPEC_FLAG):
    """Validated npuspec.SpeculativeConfig (or None); errors name the flag and the key."""
    d = spec_dict(value, field)
    if d is None:
        return None
    try:
        return SpeculativeConfig.from_dict(d)
    except ValueError as e:
        raise with_field(e, field) from None


def model_dir(path: str | None, field: str = "--model") -> str:
    """The model to load: an HF checkpoint directory with a readable config.json ('tiny' = the
    embedded model), a llama.cpp `.gguf` file, or a directory holding one GGUF (returned as the
    file's path). The config is read here, so a bad path fails before any weights are loaded."""
    try:
        gguf_file = find_gguf(path or "tiny")
        d = gguf_file or resolve_model_path(path or "tiny")
        if d == TINY_MODEL_DIR and not os.path.isfile(os.path.join(d, "config.json")):
            raise FileNotFoundError(
                f"the embedded model is missing from {d}; reinstall npuspec, or train it with "
                f"`python -m npuspec.models.train_tiny --out {d}`")
        read_model_config(d)
    except (ValueError, OSError) as e:
        raise with_field(e, field) from None
    except ImportError as e:  # a .gguf without the gguf package: the message names the install
        raise UsageError(str(e), field) from None
    return d


def resolve_model_path(path: str) -> str:
    """An HF checkpoint directory (or 'tiny'); anything else is an error naming what is accepted."""
    if path in ("tiny", None):
        return TINY_MODEL_DIR
    p = os.path.expanduser(str(path))
    if not os.path.isdir(p):
        raise FileNotFoundError(
            f"model path {p!r} is not a directory or a .gguf file; pass a local HF checkpoint "
            f"directory (config.json + *.safetensors), a llama.cpp .gguf file (or a directory "
            f"holding one), or 'tiny' for the embedded model")
    return p


def is_gguf_model(path: str) -> bool:
    """Whether model_dir() resolved `path` to a GGUF file."""
    return is_gguf_path(path) and os.path.isfile(path)


def check_draft(target_dir: str, spec, field: str = SPEC_FLAG) -> str | None:
    """For draft-model methods: the draft's directory, after checking it shares the target's
    vocabulary (a draft token id must mean the same token to the target)."""
    if spec is None or not spec.model or spec.method != "draft_model":
        return None  # hidden-state drafters: load_draft checks them against the target
    draft_dir = model_dir(spec.model, f"{field} model")
    tv, dv = read_model_config(target_dir).vocab_size, read_model_config(draft_dir).vocab_size
    if tv != dv:
        raise UsageError(f"the draft model {spec.model!r} has vocab_size={dv} but the target has "
                         f"vocab_size={tv}; speculative decoding needs a draft with the target's "
                         f"vocabulary (same tokenizer): pick a draft from the target's model family",
                         f"{field} model")
    tt, dt = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    if tt is not None and dt is not None and tt.get_vocab() != dt.get_vocab():
        raise UsageError(f"the draft model {spec.model!r} has the target's vocab_size ({tv}) but a "
                         f"different tokenizer vocabulary; use a draft trained with the "
                         f"target's tokenizer", f"{field} model")
    return draft_dir


def fit_max_model_len(model_dir: str, prompts, max_tokens: int, margin: int = 16) -> int | None:
    """The smallest max_model_len that fits every prompt (text, or a list of token ids) plus
    max_tokens, rounded up to 64 and capped at the model's max_position_embeddings: the
    smallest KV pool (attention reads each request's live length whatever this is).
    None (the engine's default) when text prompts meet a checkpoint without a tokenizer."""
    texts = [p for p in prompts if isinstance(p, str)]
    lengths = [len(p) for p in prompts if not isinstance(p, str)]
    if texts:
        tok = load_tokenizer(model_dir)
        if tok is None:
            return None
        lengths += [len(e.ids) for e in tok.encode_batch(texts)]
    need = -(-(max(lengths) + max_tokens + margin) // 64) * 64
    return min(need, read_model_config(model_dir).max_position_embeddings)


def set_threads(n: int | None, model_dir: str | None = None) -> int:
    """Apply --threads. The embedded model's matmuls are a few microseconds: with more threads
    the synchronisation costs more than it saves, and on a shared machine a preempted thread
    stalls every op (we measured 20x slower steps at 2 threads on a loaded 2-core box)."""
    if n is None and model_dir is not None and os.path.realpath(model_dir) == os.path.realpath(TINY_MODEL_DIR):
        n = 1
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def out_file(path: str | None, field: str) -> str | None:
    """An output file path whose directory exists, checked before the work that fills it."""
    if path is None:
        return None
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(d):
        what = "is a directory" if os.path.isdir(path) else f"has no directory {d}"
        raise UsageError(f"{path!r} {what}; pass a file path in an existing directory", field)
    return path


class Progress:
    """`label [#####.....] 3/8` on stderr, redrawn in place; silent unless stderr is a TTY."""

    def __init__(self, label: str, total: int, enabled: bool | None = None):
        self.label, self.total, self.n = label, max(total, 1), 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()
        self._draw()

    def _draw(self, end: str = "") -> None:
        if not self.enabled:
            return
        width = 24
        fill = int(width * self.n / self.total)
        secs = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] "
                         f"{self.n}/{self.total} {secs:5.1f}s{end}")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n = min(self.n + n, self.total)
        self._draw()

    def close(self) -> None:
        self.n = self.total
        self._draw("\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        elif self.enabled:
            sys.stderr.write("\n")
