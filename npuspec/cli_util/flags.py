"""What a command line's flags are built from, importing neither torch nor the models, so that
`--help` and argparse's own errors stay fast: the argparse types (each error names its flag),
`--threads`, and the default speculative configs. cli_util/common.py re-exports all of it
alongside the checks that need a model."""
from __future__ import annotations

import argparse
import math
import os

from npuspec.methods import names

SPEC_FLAG = "--speculative-config"


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
    """`--quantization`: LLM(quantization=...) (its values are npuspec.models.quant's
    QUANTIZATIONS, spelled out here so --help imports no torch; a test keeps them equal)."""
    p.add_argument("--quantization", default=None, choices=("gguf", "int8", "int4"),
                   help="weight-only: 'gguf' runs a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K weights as "
                        "stored; 'int8' / 'int4' quantize at load (default: weights in --dtype)")
# The demo's default: HF prompt lookup's matching rule (longest n-gram of 3 down to 1) with
# K=4; on the embedded model this accepts ~1.3 drafts per step on the demo prompts.
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
# `npuspec demo --method M` (and the benches' method rows): the embedded model's default
# speculative config per method (K = 4; the tiny heads are trained by `npuspec train-draft`,
# see npuspec/models/tiny_drafts)
METHOD_SPECS = {
    "ngram": None,  # DEFAULT_SPEC
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "eagle": {"method": "eagle", "model": "tiny-eagle", "num_speculative_tokens": 4},
    "eagle3": {"method": "eagle3", "model": "tiny-eagle3", "num_speculative_tokens": 4},
    "medusa": {"method": "medusa", "model": "tiny-medusa", "num_speculative_tokens": 4},
    "mtp": {"method": "mtp", "num_speculative_tokens": 4},
    "dflash": {"method": "dflash", "model": "tiny-dflash", "num_speculative_tokens": 7},
    "dspark": {"method": "dspark", "model": "tiny-dspark", "num_speculative_tokens": 7},
}


# Heads shipped for real targets (npuspec/models/<target>_drafts, trained by `npuspec
# train-draft`; each directory's train_recipe.json holds the command): (the target checkpoint's
# file or directory name, lower-cased, starts with this) -> that target's spec per method.
# K is the one the head's benchmark recommends (docs/train_draft.md).
TARGET_METHOD_SPECS = {
    "smollm2-135m-instruct": {
        "eagle3": {"method": "eagle3", "model": "smollm2-eagle3", "num_speculative_tokens": 3},
    },
}


def method_spec(method: str, model: str | None) -> dict | None:
    """`--method M` for the target `model` (a path; None or 'tiny' = the embedded model): its
    shipped head's spec where there is one, else METHOD_SPECS[M]. None means DEFAULT_SPEC.
    A head method with no head shipped for a real target raises ValueError naming the fix."""
    name = os.path.basename(os.path.normpath(model or "tiny")).lower()
    if name != "tiny" and method in names(needs_model=True):  # a head's checkpoint
        for prefix, specs in TARGET_METHOD_SPECS.items():
            if name.startswith(prefix) and method in specs:
                return dict(specs[method])
        raise ValueError(
            f"--method {method}: npuspec ships no {method} head for {model!r} (only for the "
            f"embedded model and {', '.join(sorted(TARGET_METHOD_SPECS))}); train one with "
            f"`npuspec train-draft --target {model} --method {method} --out DIR` and pass "
            f"--speculative-config '{{\"method\": \"{method}\", \"model\": \"DIR\"}}'")
    spec = METHOD_SPECS[method]
    return None if spec is None else dict(spec)


def add_threads_flag(p) -> None:
    p.add_argument("--threads", type=positive, default=None,
                   help="torch CPU threads (default: 1 for the embedded model, whose matrices are too "
                        "small to split, else torch's choice); 1 also gives steadier timings on a busy machine")


def positive(s: str) -> int:
    """argparse type: an int >= 1 (argparse names the flag in its error)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def finite(s: str) -> float:
    """argparse type: a finite number (float() also takes 'nan' and 'inf')."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{s!r} must be a finite number")
    return v


def int_list(s: str) -> list[int]:
    """argparse type: comma-separated ints >= 1, e.g. 1,2,4,8."""
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        v = []
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"{s!r} must be comma-separated integers >= 1 such as 1,2,4,8")
    return v


def float_list(s: str) -> list[float]:
    """argparse type: comma-separated numbers, e.g. 0.8,0.6,0.5."""
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} must be comma-separated numbers such as 0.8,0.6,0.5") from None
