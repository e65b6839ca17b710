"""Shared helpers for the graph-cache tests.

Most tests call `cached_lower` directly on a small FX graph, so they exercise the cache without
Dynamo or Inductor compile times. `fake_inductor` stands in for the Inductor lowering: it reads
and writes a file under TORCHINDUCTOR_CACHE_DIR exactly as Inductor's caches would, which shows
where the cache pointed Inductor (a private copy of the entry, never the shared directory).
"""
import dataclasses
import os
import subprocess
import sys

import torch

from npuspec.compilation import cache as core
from npuspec.compilation.backend import BackendOptions

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
_PASSES = None  # the pass uuids, computed once per test session and given to every worker


class Tiny(torch.nn.Module):
    def forward(self, x, drafts):
        target = (x * 2 + 1).argmax(-1)                                  # [B, K+1]
        return (target[:, :-1] == drafts).int().cumprod(-1).sum(-1)      # [B]


def tiny_graph(seed_shape=(2, 4, 8)):
    gm = torch.fx.symbolic_trace(Tiny())
    x = torch.randn(*seed_shape)
    d = torch.randint(0, seed_shape[-1], seed_shape[:1] + (seed_shape[1] - 1,))
    return gm, [x, d]


def opts(cache_dir, lowering="eager", **kw):
    return dataclasses.replace(BackendOptions(), cache_dir=str(cache_dir), lowering=lowering, **kw)


@dataclasses.dataclass
class FakeInductor:
    """A lowering that behaves like Inductor's on-disk cache: load if present, else 'compile'."""
    loaded: int = 0
    compiled: int = 0
    dirs: list = dataclasses.field(default_factory=list)

    def __call__(self, gm, example_inputs, o):
        d = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        self.dirs.append(d)
        p = os.path.join(d, "fxgraph", "ab", "graph.bin")
        if os.path.exists(p):
            with open(p, "rb") as f:
                assert f.read() == b"compiled-graph", p
            self.loaded += 1
        else:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(b"compiled-graph")
            self.compiled += 1
        return gm.forward


def eager_lower(gm, example_inputs, o):
    return gm.forward


def run_cached(cache_dir, lower=eager_lower, lowering="eager", shape=(2, 4, 8)):
    """One start, in process: compile the tiny graph through the cache, check that the result
    equals eager, return the key."""
    gm, inputs = tiny_graph(shape)
    want = gm(*inputs)
    fn = core.cached_lower(gm, inputs, opts(cache_dir, lowering), lower)
    assert torch.equal(fn(*inputs), want)
    return core.current().key


def key_of(shape=(2, 4, 8), lowering="eager"):
    """The key `run_cached` will use for `shape`, without compiling (to plant things under
    names the next start will touch)."""
    from npuspec.compilation import cache_keys as keys
    gm, inputs = tiny_graph(shape)
    return keys.cache_key(keys.key_parts(gm, inputs, opts("unused", lowering)))


def snapshot(top):
    """Everything below `top`, links not followed: {relative path: (type and mode, owner,
    content or link target)}, to show that nothing outside a cache was written or created."""
    out = {}
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if os.path.islink(p):
                body = ("link", os.readlink(p))
            elif os.path.isdir(p):
                body = ("dir",)
            else:
                with open(p, "rb") as f:
                    body = ("file", f.read(), st.st_nlink)
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_uid, body)
    return out


def run_worker(out, cache_dir, lowering, *extra, env=None):
    import json
    from npuspec.compilation import cache_keys as keys
    global _PASSES
    if _PASSES is None:
        _PASSES = json.dumps(list(keys.pass_uuids()))
    cmd = [sys.executable, WORKER, str(out), str(cache_dir), lowering, *map(str, extra),
           "--passes", _PASSES]
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_worker(proc, timeout=900):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, out
    return out
