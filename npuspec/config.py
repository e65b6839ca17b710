"""`SpeculativeConfig`: vLLM's `speculative_config` schema, validated (docs/engine.md; the
fields, their checks and the sub-configs are config_fields.py's).

A config written for vLLM Ascend parses here unchanged. Every rule violation is a ValueError that
names the key, the bad value and the fix; unknown keys are rejected with the nearest valid name.
`to_dict()` returns the resolved config (defaults filled in, None left out) and
`from_dict(to_dict())` gives back an equal config.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
from typing import Any, Optional

log = logging.getLogger(__name__)

from npuspec.config_fields import (ADAPTIVE_VERIFY_METHODS, DynamicSpecConfig, RejectionSamplerConfig, _bool, _check_device_limit, _check_extract_hidden_states, _err, _parse_batch_table, _parse_hybrid, _parse_k, _parse_k_controller, candidate_ks, _parse_method, _parse_model, _parse_ngram, _parse_parallel, _parse_rejection, _parse_suffix, _reject_unknown, resolve_synthetic_length)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Optional[str] = None
    draft_tensor_parallel_size: Optional[int] = None
    disable_padded_drafter_batch: bool = False
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    suffix_decoding_max_tree_depth: Optional[int] = None
    suffix_decoding_max_cached_requests: Optional[int] = None
    suffix_decoding_max_spec_factor: Optional[float] = None
    suffix_decoding_min_token_prob: Optional[float] = None
    enable_suffix_decoding: Optional[bool] = None
    suffix_min_score: Optional[float] = None
    k_controller: Optional[str] = None   # "online": npuspec/spec_decode/k_controller.py
    num_speculative_tokens_per_batch_size: Optional[tuple] = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: Optional[tuple] = None
    synthetic_acceptance_length: Optional[float] = None
    enforce_eager: Optional[bool] = None
    enable_adaptive_verification: Optional[bool] = None
    draft_model_config: Optional[dict] = None
    rejection_sampler_config: RejectionSamplerConfig = RejectionSamplerConfig()
    dynamic_spec_config: Optional[DynamicSpecConfig] = None

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_json(cls, s: str, **kw) -> "SpeculativeConfig":
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON ({e.msg} at line {e.lineno} "
                             f"column {e.colno}); write it like "
                             f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'") from None
        return cls.from_dict(d, **kw)

    @classmethod
    def from_dict(cls, d: Any, *, tensor_parallel_size: int = 1,
                  device: Optional[str] = None) -> "SpeculativeConfig":
        """Validate vLLM-style keys. `device` (default: detected) applies the NPU K+1 <= 16 limit."""
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be an object (dict), got {type(d).__name__}: "
                             f"{d!r}; e.g. {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}")
        d = copy.deepcopy(d)
        _reject_unknown(d, cls.keys(), "speculative_config")
        method = _parse_method(d)
        dmc = d.get("draft_model_config")
        if dmc is not None and not isinstance(dmc, dict):
            raise _err("draft_model_config", dmc, "must be an object such as {\"hf_config\": {...}}")
        k = _parse_k(d, method, dmc)
        f: dict[str, Any] = {"method": method, "num_speculative_tokens": k,
                             "draft_model_config": dmc}
        f["model"] = _parse_model(d, method)
        f.update(_parse_parallel(d, method, tensor_parallel_size))
        f.update(_parse_ngram(d, method))
        f.update(_parse_hybrid(d, method))
        f.update(_parse_k_controller(d, method))
        f.update(_parse_suffix(d, method))
        f.update(_parse_rejection(d, k))
        if d.get("enforce_eager") is not None:
            f["enforce_eager"] = _bool("enforce_eager", d["enforce_eager"])
        if d.get("enable_adaptive_verification") is not None:
            f["enable_adaptive_verification"] = _bool("enable_adaptive_verification",
                                                      d["enable_adaptive_verification"])
            if f["enable_adaptive_verification"] and method not in ADAPTIVE_VERIFY_METHODS:
                raise _err("enable_adaptive_verification", True,
                           f"applies only to methods {', '.join(ADAPTIVE_VERIFY_METHODS)}; "
                           f"remove it for method {method!r}")
        if d.get("num_speculative_tokens_per_batch_size") is not None:
            if method == "suffix":
                raise _err("num_speculative_tokens_per_batch_size", d["num_speculative_tokens_per_batch_size"],
                           "suffix decoding already picks its length per request; remove the table "
                           "or use another method")
            f["num_speculative_tokens_per_batch_size"] = _parse_batch_table(
                d["num_speculative_tokens_per_batch_size"], k)
        if d.get("dynamic_spec_config") is not None:
            f["dynamic_spec_config"] = DynamicSpecConfig.from_dict(d["dynamic_spec_config"], method, k)
        if method == "extract_hidden_states":
            _check_extract_hidden_states(k, dmc)
        _check_device_limit(k, device)
        return cls(**f)

    # -- queries -----------------------------------------------------------------------------

    def k_for_batch_size(self, n: int) -> int:
        """K for a step with `n` running requests (the table's rules: docs/engine.md,
        "speculative_config: keys and rules")."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"batch size {n!r} must be an integer >= 0")
        if n == 0:
            return 0
        table = self.num_speculative_tokens_per_batch_size
        if not table:
            return self.num_speculative_tokens
        k = table[0][2]
        for start, _end, kk in table:  # gaps and the tail inherit the previous range's K
            if start > n:
                break
            k = kk
        return k

    def k_values(self) -> tuple[int, ...]:
        """Every K a step can use (one graph set each), ascending."""
        table = self.num_speculative_tokens_per_batch_size
        ks = {r[2] for r in table} if table else {self.num_speculative_tokens}
        if self.online_k:  # a table's K (the controller's prior) are captured too
            ks |= set(candidate_ks(self.num_speculative_tokens))
        return tuple(sorted(ks))

    @property
    def online_k(self) -> bool:
        """K is chosen each step by the online controller (k_controller "online")."""
        return self.k_controller == "online"

    def synthetic_rates(self) -> Optional[tuple[float, ...]]:
        """Unconditional per-position acceptance rates in synthetic mode, else None."""
        if self.rejection_sample_method != "synthetic":
            return None
        if self.synthetic_acceptance_rates is not None:
            return tuple(self.synthetic_acceptance_rates)
        return resolve_synthetic_length(self.synthetic_acceptance_length, self.num_speculative_tokens)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        for fld in dataclasses.fields(self):
            v = getattr(self, fld.name)
            if v is None:
                continue
            if isinstance(v, (RejectionSamplerConfig, DynamicSpecConfig)):
                v = v.to_dict()
            elif fld.name == "num_speculative_tokens_per_batch_size":
                v = [list(r) for r in v]
            elif fld.name == "synthetic_acceptance_rates":
                v = list(v)
            else:
                v = copy.deepcopy(v)
            out[fld.name] = v
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


# ----------------------------------------------------------------------------------------------
# Field parsers: each takes the raw dict and returns validated fields.

ADDITIONAL_KEYS = ("rejection_sampler_config", "dynamic_spec_config", "draft_window_size")


def merge_additional_config(speculative_config: Any, additional_config: Optional[dict]) -> dict:
    """vLLM Ascend puts rejection_sampler_config and dynamic_spec_config in additional_config;
    fold them into the speculative_config dict npuspec validates."""
    if isinstance(speculative_config, str):
        try:
            speculative_config = json.loads(speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON ({e.msg} at line {e.lineno} "
                             f"column {e.colno})") from None
    if isinstance(speculative_config, SpeculativeConfig):
        speculative_config = speculative_config.to_dict()
    spec = dict(speculative_config or {})
    if not additional_config:
        return spec
    if not isinstance(additional_config, dict):
        raise ValueError(f"additional_config must be an object, got {additional_config!r}")
    _reject_unknown(additional_config, ADDITIONAL_KEYS, "additional_config")
    for key in ("rejection_sampler_config", "dynamic_spec_config"):
        if key in additional_config:
            if key in spec and spec[key] != additional_config[key]:
                raise ValueError(f"{key} is given both in speculative_config and in "
                                 f"additional_config with different values; keep one")
            spec[key] = additional_config[key]
    if "draft_window_size" in additional_config:
        log.warning("additional_config: draft_window_size=%r is not implemented by npuspec and has "
                    "no effect (drafts attend to the full context); remove it to silence this",
                    additional_config["draft_window_size"])
    return spec
