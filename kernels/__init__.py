"""npuspec.kernels: custom ops (torch.library), their PyTorch references, Triton kernels, CPU lowering."""
from npuspec.kernels.verify import (  # noqa: F401  (registers torch.ops.npuspec.rejection_sample)
    conditional_rates,
    rejection_sample,
    rejection_sample_reference,
    synthetic_rates_from_length,
)
from npuspec.kernels import accept  # noqa: F401,E402  (registers npuspec::greedy_accept, ratio_accept, residual_*)
