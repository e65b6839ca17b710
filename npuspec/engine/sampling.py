"""`SamplingParams`: the per-request sampling and stop settings, checked on construction."""
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Optional

import numpy as np

# vLLM SamplingParams fields npuspec does not implement: named in the error, so a vLLM user
# learns it is unsupported rather than misspelled
VLLM_ONLY = ("n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "min_p", "stop", "bad_words", "include_stop_str_in_output", "min_tokens", "logprobs",
             "prompt_logprobs", "detokenize", "skip_special_tokens",
             "spaces_between_special_tokens", "logits_processors", "truncate_prompt_tokens",
             "output_kind", "guided_decoding", "structured_outputs", "logit_bias",
             "allowed_token_ids")
SEED_RANGE = (-2**63, 2**64)     # what torch.Generator.manual_seed takes
INT64_MAX = 2**63 - 1            # top_k travels in an int64 tensor
F32_MAX = float(np.finfo(np.float32).max)  # temperature and top_p travel in float32 tensors
F32_MIN = float(np.finfo(np.float32).smallest_subnormal)


class ArgTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError, as Python raises for one, and a ValueError
    like npuspec's other argument errors (so `except ValueError` and the CLI's user-error
    mapping catch it too)."""


def a_type(v) -> str:
    """'an int', 'a NoneType': the type of `v` for an error message."""
    n = type(v).__name__
    return ("an " if n[0] in "aeiouAEIOU" else "a ") + n


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclasses.dataclass
class SamplingParams:
    """vLLM's SamplingParams subset. temperature 0 = greedy; top_k -1 or 0 = off."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    # vLLM's extra_args; npuspec reads "kv_transfer_params" ({"hidden_states_path": ...,
    # "include_output_tokens": bool}) for method extract_hidden_states
    extra_args: Optional[dict] = None

    def __new__(cls, *args, **kwargs):
        # runs before the dataclass __init__, whose own error for an unknown keyword names
        # neither the supported fields nor the nearest one
        fields = [f.name for f in dataclasses.fields(cls)]
        for k in kwargs:
            if k in fields:
                continue
            if k in VLLM_ONLY:
                raise NotImplementedError(
                    f"SamplingParams: {k}={kwargs[k]!r} is a vLLM option npuspec does not "
                    f"implement; remove it (npuspec takes {', '.join(fields)})")
            near = difflib.get_close_matches(k, fields, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(fields)}"
            raise ArgTypeError(f"SamplingParams: unknown keyword {k}={kwargs[k]!r}; {hint}")
        return super().__new__(cls)

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise a ValueError naming the first bad field, its value and the fix (also run by
        generate(), since the fields can be reassigned after construction)."""
        def bad(key, fix):
            return ValueError(f"SamplingParams: {key}={getattr(self, key)!r}: {fix}")
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be an integer >= 1 (the number of tokens to generate)")
        t = self.temperature
        if not _is_num(t) or not math.isfinite(t) or not 0 <= t <= F32_MAX:
            raise bad("temperature", f"must be a finite number in [0, {F32_MAX:.3g}] (0 = greedy)")
        p = self.top_p
        if not _is_num(p) or not F32_MIN <= p <= 1:
            raise bad("top_p", f"must be in (0, 1] and at least {F32_MIN:.3g} (float32's "
                      f"smallest, below which it rounds to 0); 1 = off")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise bad("top_k", "must be an integer >= 1 (values >= the vocabulary size keep "
                      "every token), or -1 / 0 for off")
        lo, hi = SEED_RANGE
        if self.seed is not None and (not _is_int(self.seed) or not lo <= self.seed < hi):
            raise bad("seed", "must be None or an integer in [-2**63, 2**64) (the range "
                      "torch.Generator.manual_seed takes); reduce it, e.g. seed % 2**64")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    _is_int(t) and t >= 0 for t in self.stop_token_ids):
                raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be True or False")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict such as "
                      "{'kv_transfer_params': {'include_output_tokens': True}} or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
