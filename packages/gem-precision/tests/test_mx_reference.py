"""to_mx / MXTensor / mx_mm (PyTorch path) against an independent float64 reading of OCP MX v1.0.

The oracle below shares no code with gem_precision: it decodes all 256 FP8 codes into a float64 table,
finds scale exponents with ``math.frexp`` and exact float64 comparisons, and rounds by table search with
ties broken towards the even code. ``to_mx`` must match it bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_precision import MXTensor, mx_mm, random_hadamard, to_mx

FP8 = {
    # dtype: (exponent bits, mantissa bits, bias, emax, max, has_inf)
    torch.float8_e4m3fn: (4, 3, 7, 8, 448.0, False),
    torch.float8_e5m2: (5, 2, 15, 15, 57344.0, True),
}


def fp8_table(dtype):
    """(sorted positive finite values, their codes) in float64, decoded from the bit layout."""
    ebits, mbits, bias, _, vmax, has_inf = FP8[dtype]
    vals, codes = [], []
    for code in range(128):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if has_inf and e == (1 << ebits) - 1:
            continue
        v = m * 2.0 ** (1 - bias - mbits) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias)
        if not has_inf and v > vmax:
            continue  # the E4M3 "fn" NaN code 0x7F
        vals.append(v)
        codes.append(code)
    return np.array(vals), np.array(codes)


def oracle_round(v: np.ndarray, dtype) -> np.ndarray:
    """Nearest-even FP8 codes of float64 ``v`` (already saturated to +-max)."""
    vals, codes = fp8_table(dtype)
    a = np.abs(v)
    hi = np.clip(np.searchsorted(vals, a), 0, len(vals) - 1)
    lo = np.clip(hi - 1, 0, len(vals) - 1)
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    code = np.where(pick_hi, codes[hi], codes[lo])
    return (code | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def oracle_scale_exp(amax: float, dtype, mode: str) -> int:
    _, _, _, emax, vmax, _ = FP8[dtype]
    if amax == 0.0:
        e = -1000
    elif mode == "floor":
        e = math.frexp(amax)[1] - 1 - emax  # frexp: amax = f * 2**x with f in [0.5, 1)
    else:
        e = math.ceil(math.log2(amax / vmax))
        while amax > vmax * 2.0**e:
            e += 1
        while amax <= vmax * 2.0 ** (e - 1):
            e -= 1
    return max(-127, min(127, e))


def oracle_to_mx(x: torch.Tensor, dtype, mode: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a 2-D tensor along its last dim; returns (codes [R, C], scale bytes [R, ceil(C/block)])."""
    _, _, _, _, vmax, _ = FP8[dtype]
    xf = x.to(torch.float32).double().numpy()
    r, c = xf.shape
    nb = -(-c // block)
    codes = np.zeros((r, c), np.uint8)
    scales = np.zeros((r, nb), np.uint8)
    for i in range(r):
        for j in range(nb):
            blk = xf[i, j * block : (j + 1) * block]
            if not np.all(np.isfinite(blk)):
                scales[i, j] = 255
                codes[i, j * block : (j + 1) * block] = 0x7F
                continue
            e = oracle_scale_exp(float(np.max(np.abs(blk))), dtype, mode)
            scales[i, j] = e + 127
            v = np.clip(blk / 2.0**e, -vmax, vmax)
            codes[i, j * block : (j + 1) * block] = oracle_round(v, dtype)
    return codes, scales


def wide_range_input(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Blocks of magnitudes 1e-30..1e30 with a spread inside each block, random signs, special rows."""
    g = torch.Generator().manual_seed(seed)
    base = 10.0 ** (torch.rand(rows, 1, generator=g) * 60 - 30)
    spread = 2.0 ** (torch.randn(rows, cols, generator=g) * 3)
    sign = torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1
    x = (base * spread * sign).to(torch.float32)
    x[0] = 0.0
    x[1, :5] = torch.tensor([-0.0, 1e-40, -3e-39, 1e-45, 0.0])  # fp32 subnormals and a signed zero
    x[2, 3] = float("nan")
    x[3, 7] = float("inf")
    x[4, 1] = -float("inf")
    x[5] = torch.tensor([448.0, 464.0, 57344.0, 61440.0] * (cols // 4) + [1.0] * (cols % 4))
    # Block maxima exactly at 1.75 * 2**k (the rceil boundary) and one fp32 step above it.
    x[6] = x[6] / x[6].abs().max() * 2.0**-30
    x[6, 0] = 448.0 * 2.0**-20
    x[6, -1] = -57344.0 * 2.0**10
    x[7] = x[6]
    x[7, 0] = torch.nextafter(torch.tensor(448.0 * 2.0**-20), torch.tensor(1e9))
    return x.to(dtype)


@pytest.mark.parametrize("elem_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
@pytest.mark.parametrize("shape", [(24, 64), (9, 45)])
def test_to_mx_bit_exact_vs_spec_oracle(elem_dtype, scale_mode, shape):
    x = wide_range_input(*shape, seed=shape[1] + len(scale_mode))
    mx = to_mx(x, elem_dtype=elem_dtype, scale_mode=scale_mode)
    codes, scales = oracle_to_mx(x, elem_dtype, scale_mode, 32)
    assert mx.data.dtype == elem_dtype and mx.data.shape == x.shape
    assert mx.scale.dtype == torch.uint8 and mx.scale.shape == scales.shape
    np.testing.assert_array_equal(mx.scale.numpy(), scales)
    np.testing.assert_array_equal(mx.data.view(torch.uint8).numpy(), codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_to_mx_half_inputs_bit_exact(dtype):
    x = wide_range_input(8, 96, seed=3).clamp(-6e4, 6e4).nan_to_num(0.0).to(dtype)
    for mode in ("floor", "rceil"):
        mx = to_mx(x, scale_mode=mode)
        codes, scales = oracle_to_mx(x, torch.float8_e4m3fn, mode, 32)
        np.testing.assert_array_equal(mx.scale.numpy(), scales)
        np.testing.assert_array_equal(mx.data.view(torch.uint8).numpy(), codes)
        assert mx.orig_dtype == dtype and mx.dequantize().dtype == dtype


def test_axis_and_block_size_match_transposed_oracle():
    x = wide_range_input(40, 12, seed=5)
    mx = to_mx(x, axis=0, block_size=16, scale_mode="floor")
    codes, scales = oracle_to_mx(x.t().contiguous(), torch.float8_e4m3fn, "floor", 16)
    assert mx.scale.shape == (3, 12) and mx.axis == 0
    np.testing.assert_array_equal(mx.scale.t().numpy(), scales)
    np.testing.assert_array_equal(mx.data.view(torch.uint8).t().numpy(), codes)
    # N-D: the middle axis of a 3-D tensor equals quantizing the moved-last 2-D view.
    y = torch.randn(3, 50, 4)
    mx3 = to_mx(y, axis=1)
    flat = y.movedim(1, -1).reshape(12, 50)
    ref = to_mx(flat)
    assert torch.equal(mx3.data.movedim(1, -1).reshape(12, 50).view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(mx3.scale.movedim(1, -1).reshape(12, 2), ref.scale)


def test_special_values_defined():
    x = torch.zeros(4, 32)
    x[1, 0] = float("nan")
    x[2, 5] = float("inf")
    x[3] = 1e-40  # fp32 subnormals: scale byte 0 (2**-127), elements round at that scale
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for mode in ("floor", "rceil"):
            mx = to_mx(x, elem_dtype=dt, scale_mode=mode)
            assert mx.scale[:, 0].tolist() == [0, 255, 255, 0]
            assert (mx.data.view(torch.uint8)[1:3] == 0x7F).all()
            deq = mx.dequantize(torch.float32)
            assert (deq[0] == 0).all() and deq[1:3].isnan().all()
            # 1e-40 * 2**127 = 1.7e-2: representable-ish in FP8; dequantized it stays within one step.
            assert torch.allclose(deq[3], x[3], rtol=0.25, atol=0)


def test_negative_zero_keeps_sign():
    x = torch.tensor([[-0.0] + [1.0] * 31])
    mx = to_mx(x)
    assert mx.data.view(torch.uint8)[0, 0].item() == 0x80


def test_rceil_never_saturates_floor_does():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * 10.0 ** torch.randint(-5, 5, (64, 1), generator=g)
    for dt, vmax in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        r = to_mx(x, elem_dtype=dt, scale_mode="rceil")
        f = to_mx(x, elem_dtype=dt, scale_mode="floor")
        # rceil: every block max lands in (max/2, max] (the scale is the smallest that fits).
        amax_scaled = r.data.float().abs().reshape(64, 8, 32).amax(-1)
        assert (amax_scaled <= vmax).all() and (amax_scaled > vmax / 2 * 0.99).all()
        # floor: the scaled block max lands in [2**emax, 2**(emax+1)): above max it saturates.
        assert (f.data.float().abs() == vmax).any()
        assert (f.scale.int() - r.scale.int()).abs().max() <= 1


def test_torch_fp8_cast_rounds_to_nearest_even():
    """The reference relies on torch's fp32 -> fp8 cast for round-to-nearest-even (the saturation and
    non-finite handling are ours). Check it on all midpoints and random values against the table."""
    for dt in FP8:
        vals, _ = fp8_table(dt)
        mids = (vals[1:] + vals[:-1]) / 2
        g = torch.Generator().manual_seed(1)
        rnd = torch.rand(20000, generator=g, dtype=torch.float64) * vals[-1]
        v = np.concatenate([vals, mids, -mids, rnd.numpy()]).astype(np.float32)
        got = torch.from_numpy(v).to(dt).view(torch.uint8).numpy()
        np.testing.assert_array_equal(got, oracle_round(v.astype(np.float64), dt))


@pytest.mark.parametrize("elem_dtype,floor_db", [(torch.float8_e4m3fn, 30.0), (torch.float8_e5m2, 24.0)])
def test_round_trip_error_bounds_and_sqnr(elem_dtype, floor_db):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 512, generator=g) * torch.rand(128, 1, generator=g) * 100
    mbits = FP8[elem_dtype][1]
    for mode in ("floor", "rceil"):
        mx = to_mx(x, elem_dtype=elem_dtype, scale_mode=mode)
        deq = mx.dequantize(torch.float32)
        # Elementwise: half a spacing of the element at its exponent (relative 2**-(mbits+1)) for normal
        # elements, plus half the subnormal spacing 2**(e + 1 - bias - mbits) of the block scale 2**e.
        e = (mx.scale.int() - 127).repeat_interleave(32, 1).double()
        bias = FP8[elem_dtype][2]
        bound = x.double().abs() * 2.0 ** -(mbits + 1) + 2.0 ** (e + 1 - bias - mbits - 1)
        if mode == "floor":  # saturation: the largest elements may lose up to (2 - 1.75) / 2 of their value
            bound = torch.maximum(bound, x.double().abs() * 0.125 + 1e-30)
        assert ((deq.double() - x.double()).abs() <= bound * (1 + 1e-9)).all()
        sqnr = 20 * torch.log10(x.norm() / (deq - x).norm())
        # torchao's MX round trip floors are 18 dB (e4m3) / 13 dB; a Gaussian block quantizes far better:
        # E4M3 ~ 31 dB, E5M2 ~ 25 dB (relative step 2**-4 / 2**-3). Floors 1 dB below.
        assert sqnr > floor_db, (mode, sqnr)


def test_square_tiles_valid_along_either_axis():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(70, 45, generator=g) * (10.0 ** torch.randint(-3, 3, (70, 45), generator=g))
    sq = to_mx(x, square=True)
    assert sq.scale.shape == (3, 2) and sq.blocked_along(0) and sq.blocked_along(1)
    # One scale per tile: the rceil scale of the tile's amax.
    xp = torch.zeros(96, 64)
    xp[:70, :45] = x
    amax = xp.reshape(3, 32, 2, 32).abs().amax(dim=(1, 3))
    _, scales = oracle_to_mx(amax.reshape(-1, 1), torch.float8_e4m3fn, "rceil", 1)
    np.testing.assert_array_equal(sq.scale.reshape(-1, 1).numpy(), scales)
    # Each element equals the oracle's rounding at its tile's scale.
    e = (sq.scale.int() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :45].double()
    want = oracle_round(np.clip(x.double().numpy() / 2.0 ** e.numpy(), -448, 448), torch.float8_e4m3fn)
    np.testing.assert_array_equal(sq.data.view(torch.uint8).numpy(), want)
    # The transpose is blocked along the other axis and dequantizes to the transpose.
    assert torch.equal(sq.t().dequantize(), sq.dequantize().t())


def test_mx_mm_against_fp64_of_dequantized():
    g = torch.Generator().manual_seed(3)
    for m, k, n in ((1, 32, 1), (33, 96, 17), (16, 50, 8)):
        a = torch.randn(m, k, generator=g)
        b = torch.randn(k, n, generator=g) * 1e3
        qa, qb = to_mx(a), to_mx(b, axis=0)
        out = mx_mm(qa, qb, out_dtype=torch.float32)
        ref = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64)
        # fp32 accumulation of exact products: relative error ~ sqrt(K) * 2**-24.
        assert ((out.double() - ref).norm() / ref.norm()) < 1e-6
        # and close to the unquantized product: each E4M3 operand is off by <= 2**-4 relative, so the
        # error is below ~2 * 2**-4 of |a| @ |b| (cancellation makes |a @ b| itself a poor yardstick).
        assert ((out - a @ b).abs() <= 0.13 * (a.abs() @ b.abs())).all()
    # Square and transposed operands.
    w = torch.randn(64, 96, generator=g)
    x = torch.randn(40, 96, generator=g)
    sw = to_mx(w, square=True)
    out = mx_mm(to_mx(x), sw.t(), out_dtype=torch.float32)
    ref = to_mx(x).dequantize(torch.float64) @ sw.dequantize(torch.float64).t()
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-6
    # mx_mm(a, b).dtype follows out_dtype; bf16 by default.
    assert mx_mm(to_mx(x), sw.t()).dtype == torch.bfloat16


def test_hadamard_round_trip_and_product():
    g = torch.Generator().manual_seed(4)
    h = random_hadamard(32, seed=9)
    assert torch.allclose(h @ h.t(), torch.eye(32), atol=1e-6)
    x = torch.randn(64, 128, generator=g)
    x[:, 5] *= 200.0  # an outlier column: without the transform it coarsens its whole block
    w = torch.randn(128, 48, generator=g)
    plain = (mx_mm(to_mx(x), to_mx(w, axis=0), out_dtype=torch.float32) - x @ w).norm()
    had = (mx_mm(to_mx(x, hadamard=h), to_mx(w, axis=0, hadamard=h), out_dtype=torch.float32) - x @ w).norm()
    assert had < plain  # the transform spreads the outlier over the block
    assert ((to_mx(x, hadamard=h).dequantize() - x).norm() / x.norm()) < 0.04


def test_e8m0_view():
    mx = to_mx(torch.randn(4, 64))
    if hasattr(torch, "float8_e8m0fnu"):
        assert torch.equal(mx.scale_e8m0.float(), 2.0 ** (mx.scale.float() - 127))


def test_bad_input_errors():
    with pytest.raises(TypeError, match="floating-point"):
        to_mx(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="elem_dtype"):
        to_mx(torch.ones(4, 32), elem_dtype=torch.float16)
    with pytest.raises(ValueError, match="scale_mode"):
        to_mx(torch.ones(4, 32), scale_mode="ceil")
    with pytest.raises(ValueError, match="rounding"):
        to_mx(torch.ones(4, 32), rounding="up")
    with pytest.raises(ValueError, match="out of range"):
        to_mx(torch.ones(4, 32), axis=2)
    with pytest.raises(ValueError, match="divisible"):
        to_mx(torch.ones(4, 40), hadamard=random_hadamard(32))
    with pytest.raises(ValueError, match="square"):
        to_mx(torch.ones(4, 32, 32), axis=0, square=True)
    a, b = to_mx(torch.ones(4, 64)), to_mx(torch.ones(64, 8), axis=0)
    with pytest.raises(ValueError, match="blocked along K"):
        mx_mm(a, to_mx(torch.ones(64, 8), axis=1))
    with pytest.raises(ValueError, match="block sizes"):
        mx_mm(a, to_mx(torch.ones(64, 8), axis=0, block_size=16))
    with pytest.raises(ValueError, match="inner dimensions"):
        mx_mm(a, to_mx(torch.ones(32, 8), axis=0))
    with pytest.raises(ValueError, match="Hadamard"):
        mx_mm(to_mx(torch.ones(4, 64), hadamard=random_hadamard(32)), b)
    with pytest.raises(TypeError, match="MXTensor"):
        mx_mm(a, torch.ones(64, 8))
    assert isinstance(a, MXTensor)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 5),
    cols=st.integers(0, 70),
    block=st.sampled_from([16, 32]),
    mode=st.sampled_from(["floor", "rceil"]),
    e5m2=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_to_mx_random_shapes_vs_oracle(rows, cols, block, mode, e5m2, seed):
    """Ragged shapes, empty ones included, against the oracle; dequantize and mx_mm keep the shapes."""
    dt = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-20, 20, (rows, 1), generator=g)
    mx = to_mx(x, elem_dtype=dt, scale_mode=mode, block_size=block)
    codes, scales = oracle_to_mx(x, dt, mode, block)
    np.testing.assert_array_equal(mx.scale.numpy().reshape(scales.shape), scales)
    np.testing.assert_array_equal(mx.data.view(torch.uint8).numpy(), codes)
    assert mx.dequantize().shape == x.shape
    out = mx_mm(mx, to_mx(torch.ones(cols, 3), axis=0, block_size=block), out_dtype=torch.float32)
    assert out.shape == (rows, 3)
    assert torch.allclose(out, mx.dequantize(torch.float32).sum(1, keepdim=True).expand(rows, 3), rtol=1e-5)


def test_empty_and_single_element_inputs():
    assert to_mx(torch.randn(5)).scale.shape == (1,)
    assert to_mx(torch.randn(0, 64), axis=0).scale.shape == (0, 64)
    assert to_mx(torch.randn(0, 0), square=True).scale.shape == (0, 0)
    k0 = mx_mm(to_mx(torch.randn(3, 0)), to_mx(torch.randn(0, 4), axis=0), out_dtype=torch.float32)
    assert torch.equal(k0, torch.zeros(3, 4))
    one = to_mx(torch.tensor([[3.0]]))
    assert one.dequantize().item() == 3.0 and one.scale.item() == 127 - 7  # rceil: 3 <= 448 * 2**-7


def test_dequantize_goes_through_dispatch(monkeypatch):
    """``MXTensor.dequantize`` asks :func:`gem_precision.dispatch.use_triton` (its ``backend`` argument,
    else the process-wide choice): the reference on the CPU, a clear error where Triton is forced but
    cannot run, and the kernel only where dispatch says so (``_triton_interpret_checks.py`` runs it)."""
    import gem_precision.mx.dequantize as deq_module
    from gem_precision import use_backend
    from gem_precision.dispatch import HAS_TRITON, triton_interpreted

    q = to_mx(torch.randn(8, 64) * 100)
    want = q.dequantize(torch.float32, backend="reference")
    assert torch.equal(q.dequantize(torch.float32), want)  # auto on the CPU
    assert torch.equal(q.t().dequantize(torch.float32), want.t())
    with pytest.raises(ValueError, match="backend must be one of"):
        q.dequantize(backend="cuda")
    if HAS_TRITON and not triton_interpreted():
        with pytest.raises(RuntimeError, match="triton backend needs CUDA tensors"):
            q.dequantize(backend="triton")
        with use_backend("triton"), pytest.raises(RuntimeError, match="triton backend needs CUDA tensors"):
            q.dequantize()
    asked = []
    monkeypatch.setattr(deq_module, "use_triton", lambda t, backend: asked.append(backend) or False)
    assert torch.equal(q.dequantize(torch.float32, backend="reference"), want)
    q.dequantize()
    hadamard = to_mx(torch.randn(8, 64), hadamard=random_hadamard(32))
    hadamard.dequantize()  # the kernel cannot undo a Hadamard transform: dispatch is not asked
    assert asked == ["reference", "auto"]
