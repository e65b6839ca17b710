"""Moved to `npuspec.engine.step`; these names stay importable from here."""
from npuspec.engine.step import VerifyStep, fresh_step_fn, prefill

__all__ = ["VerifyStep", "fresh_step_fn", "prefill"]
