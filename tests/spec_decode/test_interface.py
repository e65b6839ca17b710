"""The drafter interface (npuspec/spec_decode/base.py) and the method registry
(npuspec/methods.py): the engine calls only declared hooks, every drafter overrides them with
their signatures, every registered method builds through its row, and the default
draft_batch turns propose() into capped, -1 padded drafts."""
import ast
import importlib
import inspect
import os
import pkgutil

import numpy as np
import pytest

import npuspec.spec_decode
from npuspec import config_fields as config, methods
from npuspec.spec_decode.base import DraftBatch, Proposer, hooks

ENGINE = os.path.join(os.path.dirname(os.path.dirname(npuspec.spec_decode.__file__)), "engine")


def _drafter_classes():
    out = []
    for m in pkgutil.iter_modules(npuspec.spec_decode.__path__):
        mod = importlib.import_module(f"npuspec.spec_decode.{m.name}")
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass)
                if issubclass(c, Proposer) and c is not Proposer and c.__module__ == mod.__name__]
    return out


def test_engine_calls_only_declared_hooks():
    called = set()
    for name in ("llm.py", "drafting.py"):
        tree = ast.parse(open(os.path.join(ENGINE, name)).read())
        for node in ast.walk(tree):
            # self.proposer.X(...) and proposer.X(...)
            if isinstance(node, ast.Attribute) and (
                    (isinstance(node.value, ast.Attribute) and node.value.attr == "proposer")
                    or (isinstance(node.value, ast.Name) and node.value.id == "proposer")):
                called.add(node.attr)
    assert called, "the engine calls no proposer hook?"
    assert called <= hooks(), called - hooks()


@pytest.mark.parametrize("cls", _drafter_classes(), ids=lambda c: c.__name__)
def test_overrides_keep_the_hook_signatures(cls):
    assert issubclass(cls, Proposer)
    for name in hooks():
        mine = inspect.getattr_static(cls, name)
        base = inspect.getattr_static(Proposer, name)
        if mine is base or not callable(base):
            continue
        got = list(inspect.signature(getattr(cls, name)).parameters)
        want = list(inspect.signature(getattr(Proposer, name)).parameters)
        assert got[:len(want)] == want, (cls.__name__, name, got, want)


def test_every_method_has_a_builder_and_consistent_traits():
    for name, m in methods.METHODS.items():
        build = m.build_fn()
        assert callable(build) and "ctx" in inspect.signature(build).parameters, name
    assert set(config.METHODS) == set(methods.METHODS)
    assert set(config.NEEDS_MODEL) | set(config.AUTO_MODEL) == set(methods.METHODS)
    assert set(config.NEEDS_MODEL) == {"eagle", "eagle3", "dflash", "dspark", "medusa",
                                       "draft_model"}
    assert methods.names(host_only=True) == ("ngram", "suffix", "extract_hidden_states")


class _Echo(Proposer):
    """Drafts the last token over and over: the smallest token-only drafter."""

    def __init__(self):
        self.ctx = {}

    def start_request(self, req_id, prompt):
        self.ctx[req_id] = list(prompt)

    def extend(self, req_id, new_tokens):
        self.ctx[req_id] += list(new_tokens)

    def propose(self, req_ids, max_tokens):
        return [[self.ctx[r][-1]] * k for r, k in zip(req_ids, max_tokens)]

    def stop_request(self, req_id):
        del self.ctx[req_id]


class _Req:
    def __init__(self, req_id):
        self.req_id, self.generator = req_id, None


def test_default_draft_batch_caps_and_pads_propose():
    p = _Echo()
    p.start_request("a", [1, 2, 3])
    p.start_request("b", [7])
    d = p.draft_batch(DraftBatch([_Req("a"), _Req("b")], k=4, caps=[4, 1], temps=None))
    assert d.tokens.dtype == np.int64 and d.tokens.shape == (2, 4)
    assert d.tokens.tolist() == [[3, 3, 3, 3], [7, -1, -1, -1]]
    assert d.probs is None and d.conf is None
    # the optional hooks are there and do nothing
    assert p.take_path("a") is None and p.bind_target(None) is False and p.features is None


def test_isinstance_accepts_any_object_with_the_request_hooks():
    class Duck:  # the four methods of the protocol, no base class
        def start_request(self, req_id, prompt): ...
        def extend(self, req_id, new_tokens): ...
        def propose(self, req_ids, max_tokens): ...
        def stop_request(self, req_id): ...

    class Lame:
        def propose(self, req_ids, max_tokens): ...

    assert isinstance(Duck(), Proposer) and not isinstance(Lame(), Proposer)


def test_required_hooks_name_the_class_when_missing():
    class Half(Proposer):
        pass
    with pytest.raises(NotImplementedError, match="Half.propose"):
        Half().propose(["a"], 1)
