"""Helpers shared by this folder's tests: a parameter randomizer, one-sequence paged
metadata, a fixed batch for overfit checks, weight snapshots and the train-draft command."""
import torch

from npuspec.models import AttnMetadata

def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


BS = 4


def meta(positions, seq_len, nblocks):
    table = torch.arange(1, nblocks, dtype=torch.int32)[None]             # block 0 is scratch
    slots = table[0, positions // BS].long() * BS + positions % BS
    return AttnMetadata(slots[None], table, torch.tensor([seq_len], dtype=torch.int32))


class Fixed:
    """One fixed batch, for the overfit check."""

    def __init__(self, data, B, N):
        self.b = data.sample(torch.Generator().manual_seed(5), B, N)
        self.info = {"source": "fixed"}

    def sample(self, gen, B, N):
        return self.b

    def eval_set(self, n, B, N):
        return [self.b]

    def token_counts(self, V):
        return torch.ones(V)


def weights(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def cli(argv):
    from npuspec.cli import main
    return main(["train-draft"] + argv)
