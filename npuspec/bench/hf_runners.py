"""HF transformers as a benchmark row (`bench e2e`, `bench hf`): loading an HF directory or a
.gguf file, greedy / prompt lookup / assisted generate() one prompt at a time, and greedy on
left-padded static batches. transformers is optional (the [hf] extra): its import stays inside
the functions that need it."""
from __future__ import annotations

import importlib.util
import os
from typing import Callable, Sequence

import torch

from npuspec.bench.common import cut_at_eos
from npuspec.cli_util.errors import MissingExtra, UsageError
from npuspec.models.gguf import is_gguf_path


def require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise MissingExtra("transformers", "hf", "npuspec bench e2e (the HF transformers baseline)") from None
    return transformers


def require_hf_gguf(path: str, field: str = "--model") -> None:
    """transformers reads GGUF files with the `gguf` package and loads them through accelerate."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"{path} is a GGUF file, and HF transformers' GGUF loader (the baseline of "
                         f"npuspec bench e2e) needs {' and '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not installed; install with "
                         f"`pip install {' '.join(missing)}`", field)


def hf_from_pretrained(cls, path: str, **kw):
    """cls.from_pretrained on an HF directory, or on a .gguf file as (its dir, gguf_file=name)."""
    if is_gguf_path(path):
        return cls.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                   gguf_file=os.path.basename(path), **kw)
    return cls.from_pretrained(path, **kw)


def load_hf(model_dir: str, dtype: str = "float32"):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # no deprecation chatter inside the table
    transformers.logging.disable_progress_bar()

    model = hf_from_pretrained(AutoModelForCausalLM, model_dir, dtype=getattr(torch, dtype))
    return model.eval()


def hf_runner(model_fn: Callable[[], object], prompt_ids: Sequence[Sequence[int]], max_tokens: int,
              eos: Sequence[int], **gen_kwargs) -> Callable[[], Callable[[], dict]]:
    """setup for a Runner: generate() one prompt at a time (prompt lookup and assisted
    generation take batch size 1); model_fn() -> the HF model (gen_kwargs values may be
    callables, e.g. the assistant model's loader, called at setup)."""
    def setup():
        model = model_fn()
        pad = eos[0] if eos else 0
        gc = model.generation_config
        gc.temperature = gc.top_p = gc.top_k = None  # no sampling-only settings: plain greedy
        kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
                  eos_token_id=list(eos) if eos else None)
        kw.update({k: v() if callable(v) else v for k, v in gen_kwargs.items()})

        def run():
            outs = []
            with torch.inference_mode():
                for ids in prompt_ids:
                    x = torch.tensor([list(ids)], dtype=torch.long)
                    y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
                    outs.append(cut_at_eos(y[0, x.shape[1]:].tolist(), eos))
            return {"token_ids": outs, "tokens": sum(len(o) for o in outs), "metrics": None}
        return run
    return setup


def left_pad(batch: Sequence[Sequence[int]], pad: int):
    """(input_ids, attention_mask) as [B, T] long tensors, each prompt left-padded with `pad` to
    the longest (generate() appends new tokens on the right, so the prompts must end aligned)."""
    n = max(len(x) for x in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        if x:
            ids[i, n - len(x):] = torch.tensor(list(x), dtype=torch.long)
            mask[i, n - len(x):] = 1
    return ids, mask


def hf_batched_runner(model_fn: Callable[[], object], prompt_ids: Sequence[Sequence[int]],
                      max_tokens: int, eos: Sequence[int], batch_size: int
                      ) -> Callable[[], Callable[[], dict]]:
    """setup for a Runner: greedy generate() on static batches of up to `batch_size` prompts in
    order, left-padded with pad id eos[0] (or 0) under an attention mask; each output is cut at
    its first EOS (a finished row keeps emitting pad until the whole batch is done)."""
    def setup():
        model = model_fn()
        pad = eos[0] if eos else 0
        gc = model.generation_config
        gc.temperature = gc.top_p = gc.top_k = None
        kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
                  eos_token_id=list(eos) if eos else None)

        def run():
            outs = []
            with torch.inference_mode():
                for i in range(0, len(prompt_ids), batch_size):
                    x, mask = left_pad(prompt_ids[i:i + batch_size], pad)
                    y = model.generate(input_ids=x, attention_mask=mask, **kw)
                    outs.extend(cut_at_eos(row, eos) for row in y[:, x.shape[1]:].tolist())
            return {"token_ids": outs, "tokens": sum(len(o) for o in outs), "metrics": None}
        return run
    return setup

