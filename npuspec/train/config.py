"""`TrainConfig`: the settings of one `npuspec train-draft` run, checked, and the methods it
trains."""
from __future__ import annotations

import dataclasses
from typing import Optional

from npuspec.train.block import BLOCK_METHODS, check_block_config

METHODS = ("eagle3", "eagle", "medusa", "mtp") + BLOCK_METHODS


@dataclasses.dataclass
class TrainConfig:
    method: str = "eagle3"
    steps: int = 800
    batch: int = 16
    seq_len: int = 128             # rows per sequence (the window holds seq_len + 1 tokens)
    lr: float = 5e-3                # tuned for the embedded model; ~1e-4 for billion-scale targets
    warmup: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    ttt_steps: Optional[int] = None  # eagle3: 3; eagle, mtp: 1 (extra recycled steps if > 1)
    decay: float = 0.8               # step / head weights decay**s
    draft_vocab_size: Optional[int] = None  # eagle3 Vd (None: the target's V)
    num_heads: int = 4               # medusa heads
    eval_every: int = 100
    eval_k: int = 4                  # draft positions scored (medusa: num_heads)
    eval_batches: int = 4
    save_every: int = 100
    # dflash / dspark (block.py; None = the method's default, and unset for the others)
    block_size: Optional[int] = None    # query slots per block: 16 (dflash), 7 (dspark)
    num_anchors: Optional[int] = None   # random anchors (blocks) per training sequence: 16
    draft_layers: Optional[int] = None  # decoder layers of the draft: 1
    gamma: Optional[float] = None       # position weights exp(-k/gamma): 4.0
    eval_anchors: Optional[int] = None  # held-out anchors per eval sequence: 8

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: choose one of {', '.join(METHODS)}")
        check_block_config(self)
        if self.ttt_steps is None:
            self.ttt_steps = 3 if self.method == "eagle3" else 1
        for name in ("steps", "batch", "seq_len", "ttt_steps", "num_heads", "eval_k",
                     "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.seq_len < self.positions + 1:
            raise ValueError(f"seq_len={self.seq_len} must exceed the {self.positions} draft "
                             f"positions trained and scored")
        if self.method != "eagle3" and self.draft_vocab_size is not None:
            raise ValueError("draft_vocab_size applies to method 'eagle3' only")

    @property
    def positions(self) -> int:
        """Draft positions scored at eval (and the most steps any loss runs)."""
        if self.method == "medusa":
            return self.num_heads
        if self.method in BLOCK_METHODS:  # the whole block: serving's K at this block size
            return self.block_size - (1 if self.method == "dflash" else 0)
        return max(self.eval_k, self.ttt_steps)

    # fields that change the trajectory: a resumed run must agree on all of them (a field a
    # checkpoint predates reads as None, which is what the methods that lack it hold)
    TRAJECTORY = ("method", "steps", "batch", "seq_len", "lr", "warmup", "weight_decay",
                  "grad_clip", "seed", "ttt_steps", "decay", "draft_vocab_size", "num_heads",
                  "block_size", "num_anchors", "draft_layers", "gamma")
