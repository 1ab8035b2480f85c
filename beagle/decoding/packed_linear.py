"""The drafter's linear layers laid out once for the CPU's bf16 matrix units, instead of on every call.

A draft step multiplies a handful of rows (1 to top-k queries) by each weight matrix. On a CPU with AMX,
`F.linear` in bf16 lets oneDNN reorder the whole weight into its blocked layout on every call, so at these
shapes the reorder, not the multiply, is most of the time: measured on 2 cores, 4 x 576 by 576 x 1536 took
60 us, the same product on a weight reordered once 26 us; the 8,192-row draft head 335 us against 228, with
bit-identical results (docs/eval.md). A tree of depth 5 runs ~40 such products per round.

Only decoding packs (the weights never change there); training keeps plain `nn.Linear`. Packing is used only
where it is checked to give exactly what `F.linear` gives: a CPU, bf16 weights, oneDNN present and a CPU that
multiplies bf16 natively; in float32 the reordered path was not faster at these shapes and is left alone.
The oneDNN entry points are the ones torch's own compiler uses for CPU linear layers (`torch.ops.mkldnn`);
where a torch build lacks them, decoding falls back to `nn.Linear` and logs it.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from beagle.precision import cpu_has_native_bf16

logger = logging.getLogger(__name__)

ROWS_HINT = 4  # rows per product the layout is tuned for (a draft step's queries); any row count works


def _reorder(weight: Tensor) -> Tensor:
    """`weight` [out, in] in oneDNN's blocked layout for products with ~ROWS_HINT rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def _packed_product(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x [rows, in] @ weight.T (+ bias) -> [rows, out] on a weight from `_reorder`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def packing_works() -> bool:
    """True when this torch and CPU reorder bf16 weights and give exactly `F.linear`'s result (checked once)."""
    if not (torch.backends.mkldnn.is_available() and cpu_has_native_bf16()):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    rows = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    try:
        with torch.inference_mode():
            equal = torch.equal(_packed_product(rows, _reorder(weight), None), F.linear(rows, weight))
    except (RuntimeError, AttributeError) as error:  # a build without the oneDNN ops
        logger.info("bf16 weight packing unavailable (%s); drafting with nn.Linear", error)
        return False
    if not equal:
        logger.info("bf16 weight packing differs from F.linear on this CPU; drafting with nn.Linear")
    return equal


class PackedLinear(nn.Module):
    """An `nn.Linear` for inference whose weight is also kept reordered for oneDNN.

    `weight` stays the original parameter (the state dict, dtype and device reads see what they saw); the
    reordered copy is a non-persistent buffer, so nothing saved ever holds it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", _reorder(linear.weight), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)                                  # [rows, in]
        return _packed_product(rows, self.packed, self.bias).view(*x.shape[:-1], self.out_features)


def _packable(linear: nn.Linear) -> bool:
    return linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"


def pack_for_decoding(module: nn.Module) -> int:
    """Replace every bf16 CPU `nn.Linear` inside `module` by a `PackedLinear`, where packing works here.

    For decoding only: a packed layer does not follow later changes to its weight. Returns how many layers
    were packed (0 on a GPU, in float32, or where `packing_works()` is False)."""
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and _packable(child)]
    if not targets or not packing_works():
        return 0
    with torch.no_grad():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child))
    logger.debug("packed %d bf16 linear layers for decoding", len(targets))
    return len(targets)
