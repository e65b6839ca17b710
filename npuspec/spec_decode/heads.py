"""Draft heads' checkpoints: the shipped heads of the embedded model by name, and loading a
head (EAGLE, EAGLE-3, MTP, Medusa, DFlash, DSpark) for the target, sharded and packed."""
from __future__ import annotations

import os

from npuspec.models import TINY_MODEL_DIR
from npuspec.models.draft_loading import load_draft
from npuspec.models.packing import pack_draft
from npuspec.models.tp import shard_draft
from npuspec.spec_decode.base import BuildContext

# heads for the embedded model, trained by `npuspec train-draft` (their train_recipe.json
# records how), shipped beside it in npuspec/models/tiny_drafts/
TINY_DRAFTS = {"tiny-eagle": "eagle", "tiny-eagle3": "eagle3", "tiny-medusa": "medusa",
               "tiny-dflash": "dflash", "tiny-dspark": "dspark"}
# heads for real targets, in npuspec/models/<target>_drafts/<method>: name -> (folder, the
# target to pass to `npuspec train-draft` to make it again)
TARGET_DRAFTS = {"smollm2-eagle3": ("smollm2_drafts/eagle3", "<SmolLM2-135M-Instruct .gguf>")}
SHIPPED_DRAFTS = (*TINY_DRAFTS, *TARGET_DRAFTS)


def resolve_draft(name: str) -> str:
    """speculative_config.model -> a checkpoint directory ("tiny-eagle3", "smollm2-eagle3"
    etc. -> the package's)."""
    if name in TINY_DRAFTS:
        folder, target = f"tiny_drafts/{TINY_DRAFTS[name]}", "tiny"
    elif name in TARGET_DRAFTS:
        folder, target = TARGET_DRAFTS[name]
    else:
        return name
    d = os.path.join(os.path.dirname(TINY_MODEL_DIR), folder)
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise FileNotFoundError(f"speculative_config.model={name!r}: the shipped head is missing "
                                f"from this install ({d}); reinstall npuspec, or train one with "
                                f"`npuspec train-draft --target {target} --method "
                                f"{os.path.basename(folder)} --out DIR` and pass model=DIR")
    return d


def head_path(spec, target_path: str) -> str:
    """MTP's layers ship inside the target's checkpoint; every other head has its own."""
    return target_path if spec.method == "mtp" else resolve_draft(spec.model)


def load_head(ctx: BuildContext):
    """The head module on ctx.device, its layers sharded like the target's when ctx.shard is
    set (bound to the target's shard later: Proposer.bind_target), CPU projections packed."""
    s = ctx.spec
    module = load_draft(s.method, head_path(s, ctx.target_path), ctx.target.config, ctx.target,
                        dtype=ctx.dtype, device=ctx.device,
                        draft_model_config=s.draft_model_config, target_dir=ctx.target_path)
    if ctx.shard is not None:
        shard_draft(module, *ctx.shard)
    pack_draft(module)  # CPU: fused, packed projections (one kernel call each for q|k|v, gate|up)
    return module
