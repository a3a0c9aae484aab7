"""PyTorch reference of row-wise FP8 quantization: the oracle of the Triton kernels and the CPU path."""

from __future__ import annotations

import torch

from gem_precision.formats import elem_format

# Row maxima below this are treated as this, so all-zero rows get a finite scale.
AMAX_EPS = 1e-12


def quantize_rowwise_reference(
    x: torch.Tensor, elem_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x [R, C]`` to FP8 with an fp32 scale ``amax / max_elem``.

    Returns:
        ``(data [R, C] elem_dtype, scale [R, 1] fp32)`` with ``x ~= data * scale``. Non-finite values
        propagate as NaN (the scale becomes NaN or inf).
    """
    fmt = elem_format(elem_dtype)
    xf = x.to(torch.float32)
    if xf.shape[1] == 0:
        amax = xf.new_full((xf.shape[0], 1), AMAX_EPS)
    else:
        amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_EPS)
    scale = amax / fmt.max_value
    data = (xf / scale).clamp(-fmt.max_value, fmt.max_value).to(elem_dtype)
    return data, scale
