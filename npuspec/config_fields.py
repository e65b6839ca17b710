"""The fields of `speculative_config` (config.py's SpeculativeConfig): the methods' traits
from the registry (npuspec/methods.py), defaults, value checks, the rejection-sampler and
dynamic-K sub-configs, and one parser per group of keys. Each raises a ValueError naming the
key, the bad value and the fix."""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
from typing import Any, Optional

from npuspec import envs, methods
from npuspec.platform import NPU_MAX_TOKENS_PER_REQUEST, Platform, current_platform

log = logging.getLogger("npuspec.config")

METHODS = tuple(methods.METHODS)
NEEDS_MODEL = methods.names(needs_model=True)
AUTO_MODEL = methods.names(needs_model=False)
PADDED_DRAFTER = methods.names(padded_batch=True)
# Drafters that report a per-position confidence, so the confidence budget can cut their drafts.
CONFIDENCE_METHODS = methods.names(confidence=True)
ADAPTIVE_VERIFY_METHODS = methods.names(adaptive_verify=True)
# a model head on the target's features, which suffix decoding can front (hybrid.py)
HYBRID_METHODS = methods.names(hidden_states=True)
REJECTION_METHODS = ("standard", "synthetic")

SUFFIX_DEFAULTS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
NGRAM_DEFAULT = 5


def _err(key: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"speculative_config: {key}={value!r}: {fix}")


def _reject_unknown(d: dict, known, where: str) -> None:
    for k in d:
        if k not in known:
            near = difflib.get_close_matches(str(k), list(known), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(sorted(known))}"
            raise ValueError(f"{where}: unknown key {k!r}; {hint}")


def _int(key: str, v: Any, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(key, v, "must be an integer")
    if lo is not None and v < lo:
        raise _err(key, v, f"must be >= {lo}")
    if hi is not None and v > hi:
        raise _err(key, v, f"must be <= {hi}")
    return v


def _num(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _err(key, v, "must be a finite number")
    return float(v)


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _err(key, v, "must be true or false")
    return v


# ----------------------------------------------------------------------------------------------
# Nested configs (vLLM Ascend takes these in `additional_config`).

@dataclasses.dataclass(frozen=True)
class RejectionSamplerConfig:
    enable_block_verify: bool = False
    enable_entropy_verify: bool = False
    posterior_threshold: float = 0.95
    posterior_alpha: float = 0.4

    @classmethod
    def from_dict(cls, d: Any) -> "RejectionSamplerConfig":
        key = "rejection_sampler_config"
        if not isinstance(d, dict):
            raise _err(key, d, "must be an object such as {\"enable_block_verify\": true}")
        _reject_unknown(d, [f.name for f in dataclasses.fields(cls)], key)
        out = cls(
            enable_block_verify=_bool(f"{key}.enable_block_verify", d.get("enable_block_verify", False)),
            enable_entropy_verify=_bool(f"{key}.enable_entropy_verify",
                                        d.get("enable_entropy_verify", False)),
            posterior_threshold=_num(f"{key}.posterior_threshold", d.get("posterior_threshold", 0.95)),
            posterior_alpha=_num(f"{key}.posterior_alpha", d.get("posterior_alpha", 0.4)),
        )
        if not 0.0 < out.posterior_threshold <= 1.0:
            raise _err(f"{key}.posterior_threshold", out.posterior_threshold,
                       "must be in (0, 1]; the default is 0.95")
        if out.posterior_alpha < 0:
            raise _err(f"{key}.posterior_alpha", out.posterior_alpha, "must be >= 0; the default is 0.4")
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def entropy_verify(self) -> Optional[tuple[float, float]]:
        """The `entropy_verify=` argument of `rejection_sample`."""
        return (self.posterior_threshold, self.posterior_alpha) if self.enable_entropy_verify else None


_BUDGET_PARAMS = ("initial_verify_budget_per_req", "budget_update_interval", "budget_threshold",
                  "min_verify_tokens")


@dataclasses.dataclass(frozen=True)
class DynamicSpecConfig:
    """Confidence-budget dynamic K (docs/engine.md, "Dynamic K"); `method` names the drafting
    method.

    Defaults are vLLM Ascend's `DynamicSpecScheduler` ones (5, 16, 0.3, 1); the guide's
    example sets 50 and 0.7 explicitly."""
    method: str
    initial_verify_budget_per_req: int = 5
    budget_update_interval: int = 16
    budget_threshold: float = 0.3
    min_verify_tokens: int = 1

    @classmethod
    def from_dict(cls, d: Any, spec_method: str, k: int) -> "DynamicSpecConfig":
        key = "dynamic_spec_config"
        if not isinstance(d, dict):
            raise _err(key, d, "must be an object {\"method\": ..., \"method_params\": {...}}")
        _reject_unknown(d, ("method", "method_params"), key)
        method = d.get("method")
        if method != spec_method:
            raise _err(f"{key}.method", method,
                       f"must equal speculative_config.method ({spec_method!r})")
        if method not in CONFIDENCE_METHODS:
            raise _err(f"{key}.method", method,
                       f"the confidence budget needs a drafter that reports confidences: "
                       f"one of {', '.join(CONFIDENCE_METHODS)}")
        p = d.get("method_params", {})
        if not isinstance(p, dict):
            raise _err(f"{key}.method_params", p, "must be an object")
        _reject_unknown(p, _BUDGET_PARAMS, f"{key}.method_params")
        kp = f"{key}.method_params"
        out = cls(
            method=method,
            initial_verify_budget_per_req=_int(f"{kp}.initial_verify_budget_per_req",
                                               p.get("initial_verify_budget_per_req", 5), lo=1),
            budget_update_interval=_int(f"{kp}.budget_update_interval",
                                        p.get("budget_update_interval", 16), lo=1),
            budget_threshold=_num(f"{kp}.budget_threshold", p.get("budget_threshold", 0.3)),
            min_verify_tokens=_int(f"{kp}.min_verify_tokens", p.get("min_verify_tokens", 1),
                                   lo=0, hi=k),
        )
        if not 0.0 < out.budget_threshold <= 1.0:
            raise _err(f"{kp}.budget_threshold", out.budget_threshold, "must be in (0, 1]")
        return out

    def to_dict(self) -> dict:
        return {"method": self.method,
                "method_params": {n: getattr(self, n) for n in _BUDGET_PARAMS}}


# ----------------------------------------------------------------------------------------------

def _parse_batch_table(v: Any, k: int) -> tuple[tuple[int, int, int], ...]:
    key = "num_speculative_tokens_per_batch_size"
    example = "e.g. [[1, 64, 3], [65, 128, 1], [129, 512, 0]]"
    if not isinstance(v, (list, tuple)) or not v:
        raise _err(key, v, f"must be a non-empty list of [start_bs, end_bs, K], {example}")
    rows = []
    for i, row in enumerate(v):
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            raise _err(f"{key}[{i}]", row, f"each entry must be [start_bs, end_bs, K], {example}")
        start, end, kk = (_int(f"{key}[{i}]", x) for x in row)
        if not 0 < start <= end:
            raise _err(f"{key}[{i}]", list(row), "needs 0 < start_bs <= end_bs")
        if kk < 0:
            raise _err(f"{key}[{i}]", list(row), "K must be >= 0 (0 = no drafts)")
        if rows and start <= rows[-1][1]:
            raise _err(f"{key}[{i}]", list(row),
                       f"ranges must be sorted and non-overlapping; it starts at {start} but the "
                       f"previous range ends at {rows[-1][1]}")
        if kk > k:
            log.info("%s[%d]: K=%d capped at num_speculative_tokens=%d", key, i, kk, k)
            kk = k
        rows.append((start, end, kk))
    if rows[0][0] != 1:
        raise _err(f"{key}[0]", list(v[0]), "the first range must start at batch size 1")
    return tuple(rows)


def resolve_synthetic_length(length: float, k: int) -> tuple[float, ...]:
    """Acceptance length L -> unconditional per-position rates (docs/verify.md,
    "Modes", synthetic)."""
    d = length - 1.0
    f = int(math.floor(d))
    rates = [1.0] * f + [d - f] + [0.0] * max(k - f - 1, 0)
    return tuple(rates[:k])


def _mtp_default_k(draft_model_config: Optional[dict]) -> int:
    hf = (draft_model_config or {}).get("hf_config") or {}
    for name in ("n_predict", "num_nextn_predict_layers"):
        if isinstance(hf.get(name), int) and hf[name] >= 1:
            return hf[name]
    return 1  # one MTP layer, the common case (DeepSeek-V3)


def _parse_method(d: dict) -> str:
    if "method" not in d or d["method"] is None:
        raise ValueError(f"speculative_config: 'method' is required; set it to one of "
                         f"{', '.join(METHODS)}")
    m = d["method"]
    if m not in METHODS:
        near = difflib.get_close_matches(str(m), METHODS, n=1, cutoff=0.4)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise _err("method", m, f"{hint}must be one of {', '.join(METHODS)}")
    return m


def _parse_k(d: dict, method: str, dmc: Optional[dict]) -> int:
    k = d.get("num_speculative_tokens")
    if k is None:
        if method == "suffix":
            return _int("suffix_decoding_max_tree_depth",
                        d.get("suffix_decoding_max_tree_depth", 24), lo=1)
        if method == "mtp":
            return _mtp_default_k(dmc)
        raise ValueError(f"speculative_config: 'num_speculative_tokens' is required for method "
                         f"{method!r}; set it to the number of draft tokens per step, e.g. 4")
    if k == "auto":
        return AUTO_K
    return _int("num_speculative_tokens", k, lo=1)


AUTO_K = 4  # num_speculative_tokens "auto": the online controller, K up to the guide's 4
K_CONTROLLERS = envs.K_CONTROLLERS


def candidate_ks(k_max: int) -> tuple[int, ...]:
    """The K values an online engine captures: 0, the powers of two below K_max, K_max."""
    ks = {0, k_max}
    p = 1
    while p < k_max:
        ks.add(p)
        p *= 2
    return tuple(sorted(ks))


def _parse_k_controller(d: dict, method: str) -> dict:
    """k_controller: "online" (K chosen each step, up to num_speculative_tokens) or "fixed".
    Unset, it is NPUSPEC_K_CONTROLLER's value, "online" by default, wherever K can vary: not
    with synthetic acceptance (defined for a fixed K) nor extract_hidden_states (K is 1), where
    the default is "fixed" and an explicit "online" is refused. num_speculative_tokens "auto"
    means online with K up to AUTO_K. A batch-size table with online K is the controller's
    prior (docs/engine.md, "The online K controller")."""
    v = d.get("k_controller")
    auto = d.get("num_speculative_tokens") == "auto"
    if v is not None and v not in K_CONTROLLERS:
        raise _err("k_controller", v, "must be 'online' (K picked each step from measured step "
                                      "times and acceptance, up to num_speculative_tokens) or "
                                      "'fixed'")
    if v == "fixed" and auto:
        raise _err("k_controller", v, "conflicts with num_speculative_tokens 'auto' (which "
                                      "is the online controller); give a number of tokens "
                                      "instead, or remove k_controller")
    blocker = _online_blocker(d, method)
    if v is None:
        v = "online" if auto else envs.k_controller()
        if blocker is not None and not auto:  # the default applies where K can vary
            v = "fixed"
    if v == "online" and blocker is not None:
        raise _err(*blocker)
    # written out either way: to_dict() then means the same under another environment
    return {"k_controller": v}


def _online_blocker(d: dict, method: str) -> Optional[tuple]:
    """(key, value, fix) of what rules out online K, or None."""
    for key in ("synthetic_acceptance_rates", "synthetic_acceptance_length"):
        if d.get(key) is not None:
            return (key, d[key], "does not combine with k_controller 'online': synthetic "
                                 "acceptance is defined for a fixed K; remove it or set "
                                 "k_controller 'fixed'")
    if method == "extract_hidden_states":
        return ("k_controller", "online", "does not apply to method 'extract_hidden_states' "
                                          "(K is 1); remove it")
    return None


def _parse_model(d: dict, method: str) -> Optional[str]:
    model = d.get("model")
    if method in NEEDS_MODEL:
        if not isinstance(model, str) or not model:
            raise _err("model", model, f"method {method!r} needs a draft model: set 'model' to its "
                                       f"path or HF repo id")
        return model
    if model is not None:
        log.warning("speculative_config: model=%r is ignored for method %r (resolved "
                    "automatically)", model, method)
    return None


def _parse_parallel(d: dict, method: str, tp: int) -> dict:
    out: dict[str, Any] = {}
    dtp = d.get("draft_tensor_parallel_size")
    if dtp is not None:
        dtp = _int("draft_tensor_parallel_size", dtp, lo=1)
        if dtp not in (1, tp):
            raise _err("draft_tensor_parallel_size", dtp,
                       f"must be 1 or the target's tensor_parallel_size ({tp})")
        out["draft_tensor_parallel_size"] = dtp
    if d.get("disable_padded_drafter_batch") is not None:
        v = _bool("disable_padded_drafter_batch", d["disable_padded_drafter_batch"])
        if v and method not in PADDED_DRAFTER:
            raise _err("disable_padded_drafter_batch", v,
                       f"applies only to methods {', '.join(PADDED_DRAFTER)}; remove it for "
                       f"method {method!r}")
        out["disable_padded_drafter_batch"] = v
    return out


def _parse_ngram(d: dict, method: str) -> dict:
    lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
    if method != "ngram":
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None:
                raise _err(key, v, f"applies only to method 'ngram'; remove it for method {method!r}")
        return {}
    if lo is None and hi is None:
        lo = hi = NGRAM_DEFAULT
    elif lo is None:
        lo = _int("prompt_lookup_max", hi, lo=1)
    elif hi is None:
        hi = _int("prompt_lookup_min", lo, lo=1)
    lo = _int("prompt_lookup_min", lo, lo=1)
    hi = _int("prompt_lookup_max", hi, lo=1)
    if lo > hi:
        raise _err("prompt_lookup_min", lo, f"must be <= prompt_lookup_max ({hi})")
    return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}


def _parse_hybrid(d: dict, method: str) -> dict:
    """enable_suffix_decoding (a model head behind suffix decoding) and suffix_min_score."""
    on = d.get("enable_suffix_decoding")
    score = d.get("suffix_min_score")
    if on is not None:
        on = _bool("enable_suffix_decoding", on)
        if on and method not in HYBRID_METHODS:
            raise _err("enable_suffix_decoding", on,
                       f"pairs suffix decoding with a model head, for methods "
                       f"{', '.join(HYBRID_METHODS)}; for method {method!r} remove it "
                       f"(or use method 'suffix' alone)")
    if score is not None:
        if not on:
            raise _err("suffix_min_score", score, "applies only with enable_suffix_decoding: "
                                                  "true; set that too, or remove it")
        score = _num("suffix_min_score", score)
        if score < 0:
            raise _err("suffix_min_score", score, "must be >= 0 (the suffix draft's expected "
                                                  "accepted tokens; leave it out for the "
                                                  "model head's running acceptance)")
    out: dict[str, Any] = {}
    if on:
        out["enable_suffix_decoding"] = True
    if score is not None:
        out["suffix_min_score"] = float(score)
    return out


def _parse_suffix(d: dict, method: str) -> dict:
    if method != "suffix" and not d.get("enable_suffix_decoding"):
        for key in SUFFIX_DEFAULTS:
            if d.get(key) is not None:
                raise _err(key, d[key], f"applies only to method 'suffix' or with "
                                        f"enable_suffix_decoding; remove it for method {method!r}")
        return {}
    v = {key: d[key] if d.get(key) is not None else dflt
         for key, dflt in SUFFIX_DEFAULTS.items()}
    out = {
        "suffix_decoding_max_tree_depth": _int("suffix_decoding_max_tree_depth",
                                               v["suffix_decoding_max_tree_depth"], lo=1),
        "suffix_decoding_max_cached_requests": _int("suffix_decoding_max_cached_requests",
                                                    v["suffix_decoding_max_cached_requests"], lo=0),
        "suffix_decoding_max_spec_factor": _num("suffix_decoding_max_spec_factor",
                                                v["suffix_decoding_max_spec_factor"]),
        "suffix_decoding_min_token_prob": _num("suffix_decoding_min_token_prob",
                                               v["suffix_decoding_min_token_prob"]),
    }
    if out["suffix_decoding_max_spec_factor"] <= 0:
        raise _err("suffix_decoding_max_spec_factor", out["suffix_decoding_max_spec_factor"],
                   "must be > 0 (default 1.0)")
    if not 0.0 <= out["suffix_decoding_min_token_prob"] <= 1.0:
        raise _err("suffix_decoding_min_token_prob", out["suffix_decoding_min_token_prob"],
                   "must be in [0, 1] (default 0.1)")
    return out


def _parse_rejection(d: dict, k: int) -> dict:
    out: dict[str, Any] = {}
    rs = RejectionSamplerConfig.from_dict(d.get("rejection_sampler_config") or {})
    out["rejection_sampler_config"] = rs
    m = d.get("rejection_sample_method", "standard")
    if m is None:
        m = "standard"
    if m not in REJECTION_METHODS:
        raise _err("rejection_sample_method", m, f"must be one of {', '.join(REJECTION_METHODS)}")
    out["rejection_sample_method"] = m
    rates, length = d.get("synthetic_acceptance_rates"), d.get("synthetic_acceptance_length")
    if m != "synthetic":
        for key, v in (("synthetic_acceptance_rates", rates), ("synthetic_acceptance_length", length)):
            if v is not None:
                raise _err(key, v, "applies only with rejection_sample_method='synthetic'")
        return out
    if (rates is None) == (length is None):
        raise _err("rejection_sample_method", m,
                   "synthetic mode needs exactly one of synthetic_acceptance_rates (a list of K "
                   "non-increasing rates) or synthetic_acceptance_length (in [1, K+1])")
    if rs.enable_block_verify:
        raise _err("rejection_sampler_config.enable_block_verify", True,
                   "block verify cannot be combined with synthetic rejection sampling; "
                   "disable one of them")
    if rates is not None:
        if not isinstance(rates, (list, tuple)) or len(rates) != k:
            raise _err("synthetic_acceptance_rates", rates,
                       f"must be a list of num_speculative_tokens={k} rates")
        rates = tuple(_num(f"synthetic_acceptance_rates[{i}]", r) for i, r in enumerate(rates))
        for i, r in enumerate(rates):
            if not 0.0 <= r <= 1.0:
                raise _err(f"synthetic_acceptance_rates[{i}]", r, "each rate must be in [0, 1]")
            if i and r > rates[i - 1]:
                raise _err("synthetic_acceptance_rates", list(rates),
                           "rates must be non-increasing (position i+1 cannot be accepted more "
                           "often than position i)")
        out["synthetic_acceptance_rates"] = rates
    else:
        length = _num("synthetic_acceptance_length", length)
        if not 1.0 <= length <= k + 1:
            raise _err("synthetic_acceptance_length", length, f"must be in [1, K+1] = [1, {k + 1}]")
        out["synthetic_acceptance_length"] = length
    return out


def _check_extract_hidden_states(k: int, dmc: Optional[dict]) -> None:
    if k != 1:
        raise _err("num_speculative_tokens", k, "must be 1 for method 'extract_hidden_states'")
    ids = ((dmc or {}).get("hf_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise _err("draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids", ids,
                   "method 'extract_hidden_states' needs a non-empty list of layer indices, e.g. "
                   "{\"draft_model_config\": {\"hf_config\": "
                   "{\"eagle_aux_hidden_state_layer_ids\": [2, 18, 34]}}}")


def _check_device_limit(k: int, device: Optional[str]) -> None:
    if device is None:
        plat = current_platform()
    else:
        limit = NPU_MAX_TOKENS_PER_REQUEST if device == "npu" else math.inf
        plat = Platform(device, "", False, limit)
    plat.check_tokens_per_request(k)
