"""The npuspec lowering turns Inductor's per-call layout checks off only for graphs whose ops
all have trusted fakes (npuspec/compilation/lowering.py, `foreign_ops`)."""
import torch

from npuspec.compilation import lowering
from npuspec.compilation.backend import BackendOptions
from npuspec.kernels import linear_packed_cpu as lp


@torch.library.custom_op("npuspec_test_user::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def _dynamo_graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    assert len(graphs) == 1, graphs
    return graphs[0]


def test_size_asserts_off_for_npuspec_and_aten_ops_only():
    wp = lp.pack_weight(torch.randn(40, 32))
    own = _dynamo_graph(lambda x: torch.relu(lp.linear_packed(x, wp, None, 40)) + 1, torch.randn(3, 32))
    user = _dynamo_graph(lambda x: torch.ops.npuspec_test_user.twice(torch.relu(x)), torch.randn(3, 32))
    assert lowering.foreign_ops(own) == []
    assert lowering.foreign_ops(user) == ["npuspec_test_user::twice"]
    opts = BackendOptions()
    assert lowering.inductor_config_patches(opts, own)["size_asserts"] is False
    assert lowering.inductor_config_patches(opts, user)["size_asserts"] is True
    # no graph given (the pass benchmark's baseline): Inductor's default
    assert lowering.inductor_config_patches(opts)["size_asserts"] is True
