"""Run by tests/engine/test_tp.py under `torchrun --nproc-per-node 2`: every rank runs this
same script (the external launcher's contract) and writes its tokens to <out_dir>/rank<r>.json
(a file per rank: the ranks share torchrun's stdout, where their lines can interleave)."""
import json
import os
import sys

from npuspec import LLM, SamplingParams

spec = json.loads(sys.argv[1])
out_dir = sys.argv[2]
with LLM("tiny", tensor_parallel_size=2, max_model_len=256, max_num_seqs=4,
         speculative_config=spec, enforce_eager=True) as llm:
    outs = llm.generate(["def fib(n):", "The quick brown fox"],
                        SamplingParams(max_tokens=20, temperature=0))
    with open(os.path.join(out_dir, f"rank{llm.tp.rank}.json"), "w") as f:
        json.dump({"rank": llm.tp.rank, "launcher": llm.tp.launcher,
                   "tokens": [o.outputs[0].token_ids for o in outs]}, f)
