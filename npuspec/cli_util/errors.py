"""Errors a person can act on: one line on stderr, exit code 2, no traceback unless --debug.

A *user* error is something the person running the command can fix (bad JSON, an unknown
method, a missing model path, a draft with another vocabulary, a missing optional package).
npuspec raises those as ValueError / FileNotFoundError / NotImplementedError whose message
already names the key and the fix; `run_command` turns them into one line and exit code 2.
Anything else is a bug: one line too (exit 1), with a hint to rerun with --debug.
"""
from __future__ import annotations

import sys
import traceback
from typing import Callable

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

# Set by `npuspec --debug bench NAME ...`: the bench scripts' own run_command calls then let
# exceptions through too (their argparse never sees --debug).
DEBUG = False


class UsageError(ValueError):
    """A problem with what the user asked for. `field` names the flag or key at fault."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class MissingExtra(UsageError):
    """An optional package (transformers, matplotlib) is needed for the requested feature."""

    def __init__(self, package: str, extra: str, feature: str):
        super().__init__(f"{feature} needs {package}, which is not installed; install it with "
                         f"`pip install 'npuspec[{extra}]'` (or `pip install {package}`)")


# Exceptions whose message is written for the user (see the module docstring).
USER_ERRORS = (UsageError, ValueError, FileNotFoundError, NotADirectoryError, NotImplementedError,
               PermissionError)


def one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def with_field(e: BaseException, field: str) -> UsageError:
    """Re-label a user error with the flag it came from (`--model: ...`)."""
    return UsageError(one_line(str(e)), field)


def run_command(fn: Callable[[], int | None], prog: str, debug: bool = False) -> int:
    """Run fn() and map exceptions to exit codes; with debug, let them raise."""
    if debug or DEBUG:
        rc = fn()
        return EXIT_OK if rc is None else int(rc)
    try:
        rc = fn()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # argparse inside a bench script: it already printed its message
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    except USER_ERRORS as e:
        print(f"{prog}: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a bug: still one line, but say how to get the traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"{prog}: internal error: {type(e).__name__}: {one_line(str(e))} "
              f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}; rerun with --debug for the "
              f"traceback and please report it)", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK if rc is None else int(rc)
