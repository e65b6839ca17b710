"""npuspec.passes: FX passes that find speculative verify steps and fuse them (docs/passes.md)."""
from npuspec.passes.manager import (  # noqa: F401
    FLAVORS,
    InductorVerifyPass,
    PassManager,
    run_passes,
)
from npuspec.passes.patterns import (  # noqa: F401
    GivenResidual,
    GreedyAccept,
    GreedyVerify,
    RatioAccept,
    Residual,
    VerifyPattern,
    default_patterns,
)
from npuspec.passes.patterns_sample import SampleVerify  # noqa: F401


def pass_uuids() -> tuple:
    """uuids of the default pipeline, in run order: the manager's (it covers its own and the
    canonicaliser's source and every family's uuid), then each family's. For cache keys."""
    pm = PassManager()
    return (pm.uuid(),) + tuple(p.uuid() for p in pm.patterns)
