"""Input checks of the public API: integer inputs refused everywhere, block sizes limited to what the kernels
support (the allowed values in the message), shape errors naming the operands as the user passed them."""

import pytest
import torch

from gem_precision import MXFP8Linear, MXTensor, Recipe, fp8_rowwise_mm, mx_mm, quantize_rowwise, to_mx


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_non_float_inputs_are_refused_everywhere(dtype):
    x = torch.ones(4, 32).to(dtype)
    f = torch.ones(4, 32)
    with pytest.raises(TypeError, match=r"quantize_rowwise: x must be a floating-point tensor"):
        quantize_rowwise(x)
    with pytest.raises(TypeError, match=r"to_mx: x must be a floating-point tensor"):
        to_mx(x)
    with pytest.raises(TypeError, match=r"fp8_rowwise_mm: a must be a floating-point tensor"):
        fp8_rowwise_mm(x, f)
    with pytest.raises(TypeError, match=r"fp8_rowwise_mm: b must be a floating-point tensor"):
        fp8_rowwise_mm(f, x)
    with pytest.raises(TypeError, match=r"MXFP8Linear: input must be a floating-point tensor"):
        MXFP8Linear(32, 8)(x)
    good = to_mx(f)
    bad = MXTensor(good.data.view(torch.uint8), good.scale, 32, 1, torch.float32)
    with pytest.raises(TypeError, match=r"mx_mm: a\.data must be float8_e4m3fn or float8_e5m2"):
        mx_mm(bad, to_mx(torch.ones(32, 3), axis=0))


@pytest.mark.parametrize("block_size", [7, 33, 8, 0, -32, 256, True])
def test_block_sizes_are_those_the_kernels_support(block_size):
    msg = r"block_size must be one of \(16, 32, 64, 128\), got"
    with pytest.raises(ValueError, match=f"to_mx: {msg}"):
        to_mx(torch.ones(4, 64), block_size=block_size)
    with pytest.raises(ValueError, match=f"Recipe: {msg}"):
        Recipe(block_size=block_size)


@pytest.mark.parametrize(("a_t", "b_t"), [(False, False), (True, False), (False, True), (True, True)])
def test_fp8_rowwise_mm_k_mismatch_names_the_operands_as_passed(a_t, b_t):
    a = torch.ones(8, 5) if a_t else torch.ones(5, 8)  # K = 8 either way
    b = torch.ones(7, 3) if b_t else torch.ones(3, 7)  # K = 7 either way
    with pytest.raises(ValueError, match="K differs") as e:
        fp8_rowwise_mm(a, b, a_t=a_t, b_t=b_t)
    msg = str(e.value)
    assert f"a has shape {tuple(a.shape)} and b has shape {tuple(b.shape)}" in msg
    assert f"a.shape[{0 if a_t else 1}]" + (" (a_t=True)" if a_t else "") + " = 8" in msg
    assert f"b.shape[{0 if b_t else 1}]" + (" (b_t=True)" if b_t else "") + " = 7" in msg
    with pytest.raises(ValueError, match=r"fp8_rowwise_mm: a must be 2-D"):
        fp8_rowwise_mm(torch.ones(2, 3, 4), b)
