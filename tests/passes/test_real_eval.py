"""passes/rewrites/nodes.py `real_eval`: what the region checks evaluate under, from inside a
compile (a fake mode active, the Python dispatcher on): real tensors, no autograd, no Python
dispatcher, and all of it restored after."""
from __future__ import annotations

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from npuspec.passes.rewrites.nodes import real_eval

_PY = torch._C.DispatchKey.PythonDispatcher


def _python_dispatcher_on() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(_PY)


def test_real_eval_inside_a_compile_s_state():
    with FakeTensorMode(), enable_python_dispatcher():
        assert _python_dispatcher_on() and isinstance(torch.ones(2), FakeTensor)
        with real_eval():
            x = torch.arange(4) * 2
            assert not isinstance(x, FakeTensor) and x.tolist() == [0, 2, 4, 6]
            assert not _python_dispatcher_on()
            assert torch.is_inference_mode_enabled()
        assert _python_dispatcher_on() and isinstance(torch.ones(2), FakeTensor)
        assert not torch.is_inference_mode_enabled()
