"""`SamplingParams`: the per-request sampling and stop settings, checked on construction."""
from __future__ import annotations

import dataclasses
from typing import Optional


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

    def __post_init__(self):
        def bad(key, fix):
            return ValueError(f"SamplingParams: {key}={getattr(self, key)!r}: {fix}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens <= 0:
            raise bad("max_tokens", "must be an integer >= 1 (the number of tokens to generate)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1] (1 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or -1 / 0 for off")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer or None")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in self.stop_token_ids):
                raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict such as "
                      "{'kv_transfer_params': {'include_output_tokens': True}} or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
