"""Moved to `npuspec.engine.request` (Request) and `npuspec.engine.scheduler`; these names stay
importable from here."""
from npuspec.engine.request import Request
from npuspec.engine.scheduler import Scheduler, fill_drafts, pad_rows

__all__ = ["Request", "Scheduler", "pad_rows", "fill_drafts"]
