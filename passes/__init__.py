"""npuspec.passes: FX passes that find speculative verify steps and fuse them (docs/passes.md)."""
from npuspec.passes.manager import (  # noqa: F401
    FLAVORS,
    InductorVerifyPass,
    PassManager,
    run_passes,
)
from npuspec.passes.patterns import (  # noqa: F401
    GreedyAccept,
    GreedyVerify,
    RatioAccept,
    Residual,
    VerifyPattern,
    default_patterns,
)
