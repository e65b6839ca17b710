"""`npuspec CMD --help` and argparse's flag errors import neither torch nor the engine: each
subcommand's flags live in a module that does not (its `run` imports the part that does), so
they answer in a tenth of a second, not the seconds torch's import takes."""
import subprocess
import sys

import pytest

from npuspec.cli import COMMANDS

HEAVY = ("torch", "npuspec.engine", "npuspec.models")
PROBE = ("import sys\n"
         "from npuspec.cli import main\n"
         "rc = main(sys.argv[1:])\n"
         f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules])\n"
         "sys.exit(rc)\n")


def _probe(*argv):
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout.rsplit("HEAVY ", 1)[-1].strip(), r.stderr


@pytest.mark.parametrize("cmd", sorted(COMMANDS) + ["cache"])
def test_help_imports_no_torch(cmd):
    rc, heavy, err = _probe(cmd, "--help")
    assert rc == 0, err
    assert heavy == "[]", f"npuspec {cmd} --help imported {heavy}"


@pytest.mark.parametrize("argv, flag", [(["serve", "--port", "x"], "--port"),
                                        (["demo", "--max-tokens", "0"], "--max-tokens"),
                                        (["plan", "--max-num-seqs", "0"], "--max-num-seqs"),
                                        (["tune", "--max-num-seqs", "0"], "--max-num-seqs"),
                                        (["cache", "prune", "--older-than", "nan"], "--older-than"),
                                        (["cache"], "choose an action")])
def test_flag_errors_import_no_torch(argv, flag):
    rc, heavy, err = _probe(*argv)
    assert rc == 2 and flag in err, err
    assert heavy == "[]", f"npuspec {' '.join(argv)} imported {heavy}"
