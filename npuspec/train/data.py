"""What a drafter trains on (drafters.md §1.5, §9.4): `Batch` (tokens and what the target
computed on them), the stdlib corpus with the target run live (`CorpusData`), or
extract_hidden_states files captured from the engine (`FileData`)."""
from __future__ import annotations

import dataclasses
import glob
import os
import sys
import sysconfig
from typing import Optional, Sequence

import torch
from safetensors import safe_open

from npuspec.cli_util.prompts import DEMO_PROMPTS, code_edit_requests, open_ended_requests
from npuspec.models.train_tiny import EOT, read_texts, stdlib_files
from npuspec.spec_decode.extract_files import load_hidden_states

EVAL_SEED = 1234


@dataclasses.dataclass
class Batch:
    """N tokens per row and what the target computed on them (fp32)."""
    ids: torch.Tensor                 # int64 [B, N]
    mask: torch.Tensor                # bool [B, N]: real tokens (right padding is False)
    final: torch.Tensor               # [B, N, H] the target's post-norm final hidden
    logits: torch.Tensor              # [B, N, V] the target's logits
    aux: Optional[torch.Tensor] = None  # [B, N, n_aux*H] EAGLE-3 aux features

    @property
    def rows(self) -> int:
        return self.ids.shape[1] - 1



@dataclasses.dataclass
class Corpus:
    train: torch.Tensor   # token ids, files separated by `sep`
    val: torch.Tensor
    info: dict


def stdlib_corpus(tokenizer, max_files: int = 0, sep_id: Optional[int] = None) -> Corpus:
    """The embedded model's corpus (npuspec.models.train_tiny): the stdlib's *.py files, the
    same last 2% held out for validation. Files that contain one of the built-in demo / bench
    prompts (npuspec/cli_util/prompts.py) are dropped, so acceptance on them is not memorized."""
    files = stdlib_files()
    if max_files:
        files = files[:max_files]
    if len(files) < 2:
        raise ValueError("the stdlib corpus needs at least 2 files (one held out)")
    n_val = max(1, len(files) // 50)
    prompts = ([p for p in DEMO_PROMPTS] + [r["code"] for r in code_edit_requests()]
               + [r["prompt"] for r in open_ended_requests()])
    texts = read_texts(files)
    keep = [not any(p in t for p in prompts) for t in texts]
    dropped = [f for f, k in zip(files, keep) if not k]
    if sep_id is None:
        sep_id = tokenizer.token_to_id(EOT)
    if sep_id is None:
        raise ValueError("the tokenizer has no <|endoftext|> token; pass sep_id (the target's "
                         "eos_token_id) to separate files")

    def encode(ts):
        ids = []
        for enc in tokenizer.encode_batch(ts):
            ids += enc.ids
            ids.append(sep_id)
        return torch.tensor(ids, dtype=torch.int32)

    tr = [t for t, k in zip(texts[:-n_val], keep[:-n_val]) if k]
    va = [t for t, k in zip(texts[-n_val:], keep[-n_val:]) if k]
    train_ids, val_ids = encode(tr), encode(va)
    info = {"source": "stdlib", "root": sysconfig.get_paths()["stdlib"],
            "python": sys.version.split()[0], "train_files": len(tr), "val_files": len(va),
            "held_out": [os.path.basename(f) for f in files[-n_val:]][:20],
            "dropped_for_prompts": [os.path.basename(f) for f in dropped],
            "train_tokens": int(train_ids.numel()), "val_tokens": int(val_ids.numel())}
    return Corpus(train_ids, val_ids, info)


def _target_split(target, aux_ids: tuple, ids: torch.Tensor):
    """Run the target on ids [B, N] -> (logits, final post-norm hidden, aux or None)."""
    with torch.no_grad():
        logits, feats = target.forward_causal(ids, aux_ids=tuple(aux_ids), final=True)
    H = target.config.hidden_size
    aux = feats[..., :-H] if aux_ids else None
    return logits.float(), feats[..., -H:].float(), None if aux is None else aux.float()


class CorpusData:
    """Random windows of a token stream; the target computes features and logits each batch."""

    def __init__(self, target, train_ids: torch.Tensor, val_ids: torch.Tensor,
                 aux_ids: tuple = (), info: Optional[dict] = None):
        self.target, self.aux_ids = target, tuple(aux_ids)
        self.train_ids, self.val_ids = train_ids, val_ids
        self.info = {"source": "corpus", **(info or {})}

    def _windows(self, data, gen, B, N):
        if len(data) < N + 1:
            raise ValueError(f"the corpus split has {len(data)} tokens, fewer than one window "
                             f"of {N}; use a smaller seq_len or more files")
        starts = torch.randint(0, len(data) - N, (B,), generator=gen)
        return data[starts[:, None] + torch.arange(N)].long()

    def _batch(self, ids):
        logits, final, aux = _target_split(self.target, self.aux_ids, ids)
        return Batch(ids, torch.ones_like(ids, dtype=torch.bool), final, logits, aux)

    def sample(self, gen: torch.Generator, B: int, N: int) -> Batch:
        return self._batch(self._windows(self.train_ids, gen, B, N))

    def eval_set(self, n: int, B: int, N: int) -> list[Batch]:
        gen = torch.Generator().manual_seed(EVAL_SEED)
        return [self._batch(self._windows(self.val_ids, gen, B, N)) for _ in range(n)]

    def token_counts(self, V: int) -> torch.Tensor:
        return torch.bincount(self.train_ids.long(), minlength=V)[:V]


class FileData:
    """extract_hidden_states files (`npuspec.spec_decode.extract_files`): token_ids [T] and
    hidden_states [T, n, H] captured with layer ids aux + [L] (L = num_hidden_layers: the final
    residual before the norm, from which the target's logits are recomputed). `n_aux` is how many
    leading layers are EAGLE-3 aux features (0 for the other methods, which use only the last)."""

    def __init__(self, target, files: Sequence[str], n_aux: int = 0, val_fraction: float = 0.1):
        files = sorted(files)
        if len(files) < 2:
            raise ValueError(f"--data: {len(files)} hidden states file(s); need at least 2 "
                             "(one is held out for validation)")
        self.target, self.n_aux = target, n_aux
        n_val = max(1, int(round(len(files) * val_fraction)))
        self.train_files, self.val_files = files[:-n_val], files[-n_val:]
        self.info = {"source": "hidden_states_files",
                     "dir": os.path.dirname(os.path.abspath(files[0])),
                     "train_files": len(self.train_files), "val_files": len(self.val_files)}
        self._check(self._load(files[0]), files[0])

    def _load(self, path):
        return load_hidden_states(path)

    def _check(self, d, path):
        hs = d["hidden_states"]
        H, L = self.target.config.hidden_size, self.target.config.num_layers
        ok = hs.dim() == 3 and hs.shape[2] == H and (
            hs.shape[1] == self.n_aux + 1 if self.n_aux else hs.shape[1] >= 1)
        if not ok or d["token_ids"].shape[0] != hs.shape[0]:
            want = f"[T, {self.n_aux + 1}, {H}]" if self.n_aux else f"[T, n, {H}]"
            raise ValueError(
                f"{path}: hidden_states has shape {list(hs.shape)}, expected {want}: capture "
                f"with eagle_aux_hidden_state_layer_ids = aux ids + [{L}] (the aux layer(s), "
                f"then layer {L}: the final residual before the norm, always last)")

    def _rows(self, path, gen, N):
        d = self._load(path)
        self._check(d, path)
        tok, hs = d["token_ids"].long(), d["hidden_states"]
        T = tok.shape[0]
        start = int(torch.randint(0, T - N + 1, (1,), generator=gen)) if T > N else 0
        return tok[start:start + N], hs[start:start + N].float()

    def _batch(self, rows, N):
        B = len(rows)
        n, H = rows[0][1].shape[1], self.target.config.hidden_size
        ids = torch.zeros(B, N, dtype=torch.long)
        mask = torch.zeros(B, N, dtype=torch.bool)
        hs = torch.zeros(B, N, max(n, self.n_aux + 1), H)
        for b, (t, h) in enumerate(rows):
            if h.shape[1] != n:
                raise ValueError("--data: the files hold different numbers of layers; capture "
                                 "them all with the same eagle_aux_hidden_state_layer_ids")
            ids[b, :len(t)], mask[b, :len(t)], hs[b, :len(t)] = t, True, h
        if int(ids.max()) >= self.target.config.vocab_size:
            raise ValueError("--data: token ids beyond the target's vocabulary; the files were "
                             "captured with another model")
        with torch.no_grad():
            final = self.target.final_norm(hs[:, :, -1]).float()
            logits = self.target.head(final).float()
        aux = hs[:, :, :self.n_aux].flatten(2) if self.n_aux else None
        return Batch(ids, mask, final, logits, aux)

    def sample(self, gen: torch.Generator, B: int, N: int) -> Batch:
        pick = torch.randint(0, len(self.train_files), (B,), generator=gen).tolist()
        return self._batch([self._rows(self.train_files[i], gen, N) for i in pick], N)

    def eval_set(self, n: int, B: int, N: int) -> list[Batch]:
        gen = torch.Generator().manual_seed(EVAL_SEED)
        out = []
        for i in range(n):
            files = [self.val_files[(i * B + b) % len(self.val_files)] for b in range(B)]
            out.append(self._batch([self._rows(f, gen, N) for f in files], N))
        return out

    def token_counts(self, V: int) -> torch.Tensor:
        counts = torch.zeros(V, dtype=torch.long)
        for f in self.train_files:
            with safe_open(f, framework="pt") as fh:
                counts += torch.bincount(fh.get_tensor("token_ids").long(), minlength=V)[:V]
        return counts


def hidden_state_files(directory: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"--data {directory!r}: no *.safetensors hidden states files "
                                "(written by LLM(speculative_config={'method': "
                                "'extract_hidden_states', ...}, kv_transfer_config=...))")
    return files
