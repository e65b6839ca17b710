"""The --offline regime's other two sides of `npuspec bench serve`: `npuspec.LLM` in the bench's
process (`Offline`) and the server's engine process alone, fed over its pipe (`PipeOnly`)."""
from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

from npuspec.cli_util import common
from npuspec.engine import LLM, SamplingParams
from npuspec.serve.args import add_arguments
from npuspec.serve.core import add_message
from npuspec.serve.engine import EngineClient


class Offline:
    """npuspec.LLM in this process with the server's model and config, one request at a time."""

    def __init__(self, mdir: str, spec: Optional[dict], max_tokens: int, max_num_seqs: int,
                 max_model_len: Optional[int], compilation_config: Optional[dict],
                 threads: Optional[int], enforce_eager: bool = False):
        common.set_threads(threads, mdir)  # as the server does with the same flag
        cfg = common.spec_config(spec)
        self.llm = LLM(model=mdir, speculative_config=cfg.to_dict() if cfg else None,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       compilation_config=compilation_config, enforce_eager=enforce_eager)
        self.sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(self, prompts: Sequence[str]) -> dict:
        texts, tokens = [], 0
        t0 = time.perf_counter()
        for p in prompts:
            out = self.llm.generate([p], self.sp)[0].outputs[0]
            texts.append(out.text)
            tokens += len(out.token_ids)
        return {"seconds": time.perf_counter() - t0, "tokens": tokens, "texts": texts}


class PipeOnly:
    """The server's engine process alone: started by the same code and flags as `npuspec serve`
    (npuspec.serve.engine.EngineClient), fed over its pipe from this process, no HTTP. Between
    offline and server, it tells the engine process's cost from the HTTP side's."""

    def __init__(self, serve_args: Sequence[str], max_tokens: int):
        p = argparse.ArgumentParser()
        add_arguments(p)
        self.client = EngineClient(p.parse_args(list(serve_args)))
        self.sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self._ids = 0

    def _one(self, prompt: str) -> list[int]:
        c = self.client
        self._ids += 1
        r = c.new_request(prompt, self.sp, f"pipe-{self._ids}")
        c.conn.send(add_message(r, time.perf_counter()))
        toks: list[int] = []
        while True:
            msg = c.conn.recv()
            assert msg[0] == "step", msg
            for o in msg[1]:
                toks += o.token_ids
                if o.finish_reason is not None:
                    return toks

    def run(self, prompts: Sequence[str]) -> dict:
        t0 = time.perf_counter()
        outs = [self._one(p) for p in prompts]
        return {"seconds": time.perf_counter() - t0, "tokens": sum(map(len, outs)),
                "texts": [self.client.tokenizer.decode(t, skip_special_tokens=True) for t in outs]}

    def close(self) -> None:
        self.client.close()
