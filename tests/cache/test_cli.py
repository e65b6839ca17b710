"""`npuspec cache ls | verify | prune | clear` on a directory built through cached_lower."""
import os
import time

import pytest

from npuspec.cli import cache as cli
from npuspec.compilation.cache import cached_lower
from npuspec.graphs.cache import CacheDir

from cache_helpers import eager_lower, opts, tiny_graph


def build(root, shapes=((2, 4, 8), (3, 4, 8))):
    for s in shapes:
        gm, inputs = tiny_graph(s)
        cached_lower(gm, inputs, opts(root), eager_lower)
        cached_lower(gm, inputs, opts(root), eager_lower)  # one hit each
    return CacheDir(str(root)).keys()


def test_ls_verify_prune_clear(tmp_path, capsys, monkeypatch):
    keys = build(tmp_path)
    assert len(keys) == 2
    assert cli.main(["ls", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:16].strip()
            and line.split()[0] in {k[:16] for k in keys}}
    assert set(rows) == {k[:16] for k in keys}, out
    for r in rows.values():
        assert r[-1] == "1" and r[-2] == "eager" and any(c.startswith("cpu:") for c in r), r

    assert cli.main(["verify", "--dir", str(tmp_path)]) == 0
    assert "2 entries checked, 0 problems" in capsys.readouterr().out

    p = os.path.join(tmp_path, "entries", keys[0], "json", "key.json")
    with open(p, "r+b") as f:
        f.write(b"X")
    assert cli.main(["verify", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD       {keys[0]}" in out and "sha256" in out
    assert cli.main(["verify", "--quarantine", "--dir", str(tmp_path)]) == 1
    assert CacheDir(str(tmp_path)).keys() == [keys[1]]
    assert len(os.listdir(tmp_path / "quarantine")) == 1
    capsys.readouterr()

    assert cli.main(["prune", "--older-than", "1", "--dir", str(tmp_path)]) == 0
    assert CacheDir(str(tmp_path)).keys() == [keys[1]]  # fresh: kept
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 2 * 86400)
    assert cli.main(["prune", "--older-than", "1", "--dir", str(tmp_path)]) == 0
    monkeypatch.undo()
    assert CacheDir(str(tmp_path)).keys() == []
    assert os.listdir(tmp_path / "quarantine") == []
    assert "pruned 1 entry" in capsys.readouterr().out

    build(tmp_path)
    assert cli.main(["clear", "--dir", str(tmp_path)]) == 0
    assert CacheDir(str(tmp_path)).keys() == [] and os.listdir(tmp_path / "hits") == []


def test_verify_reports_an_untrusted_directory(tmp_path, capsys):
    build(tmp_path, shapes=((2, 4, 8),))
    os.chmod(tmp_path, 0o777)
    try:
        assert cli.main(["verify", "--dir", str(tmp_path)]) == 1
    finally:
        os.chmod(tmp_path, 0o755)
    out = capsys.readouterr().out
    assert "UNTRUSTED" in out and f"chmod -R o-w {tmp_path}" in out


def test_errors_name_the_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NPUSPEC_CACHE_DIR", raising=False)
    assert cli.main(["ls"]) == 2
    assert "--dir DIR or set NPUSPEC_CACHE_DIR" in capsys.readouterr().err
    assert cli.main(["ls", "--dir", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["prune", "--dir", str(tmp_path)])  # --older-than is required


def test_mounted_in_the_npuspec_command(tmp_path, capsys):
    from npuspec.cli import main
    build(tmp_path, shapes=((2, 4, 8),))
    assert main(["cache", "ls", "--dir", str(tmp_path)]) == 0
    assert "npuspec cache" in capsys.readouterr().out
