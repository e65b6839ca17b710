"""What every npuspec command-line program shares: the `npuspec` CLI (npuspec/cli), the server
(npuspec/serve), the benchmarks (npuspec/bench) and train-draft (npuspec/train).

    errors.py   errors a person can act on: one line, exit code 2 (UsageError, run_command)
    flags.py    what flags are built from, without torch: argparse types, --threads, the
                default speculative configs (so `--help` and flag errors stay fast)
    common.py   argument checks (--model, --speculative-config, --threads; flags.py's names
                too), a progress bar
    prompts.py  the built-in prompt sets (the demo's code prompts, `--prompts code-edit|open-ended`)

It sits above npuspec.models and npuspec.config and below everything that parses a command line
(docs/design.md).
"""
