"""The op face of row-wise FP8: quantizers and GEMMs with one fp32 scale per row along K
(``torch._scaled_mm`` on CUDA, emulated elsewhere; the quantizers' kernels in :mod:`.triton`).

Shapes the FP8 path cannot take run in the input precision instead of failing (:func:`rowwise_fallback`):
``torch._scaled_mm`` needs K and N to be multiples of 16, so K (often the token count, which varies from
batch to batch in the weight-gradient GEMM) is zero-padded to a multiple of 16 inside the quantizer, which
is exact, and a GEMM with N not a multiple of 16, or with M or K below 16, runs unquantized. The same rule
applies on every device, so CPU tests see the GPU's decisions.
"""

from __future__ import annotations

import torch

from gem_precision.dispatch import use_triton
from gem_precision.formats import check_float_tensor, elem_format
from gem_precision.roofline import fp8_gemm_speedup, rates_for
from gem_precision.rowwise.reference import quantize_rowwise_reference

FP8_ALIGN = 16  # torch._scaled_mm: K and N multiples of 16 (16-byte rows of FP8 for the tensor cores)
# A GEMM with fewer rows (M) or a shorter sum (K) than this gains nothing from FP8 (it is all quantization
# overhead and launch latency; e.g. the PMA seed projections have M = 4) and runs unquantized.
MIN_FP8_DIM = 16


def rowwise_fallback(
    m: int,
    k: int,
    n: int,
    *,
    min_speedup: float = 0.0,
    a_t: bool = False,
    b_t: bool = False,
    precise: bool = False,
    device: torch.device | str | None = None,
    b_cached: bool = False,
) -> str | None:
    """Why the FP8 row-wise path does not take the GEMM ``[M, K] @ [K, N]`` (None if it does).

    K need not be a multiple of 16 (it is zero-padded); N must be; M and K must be at least
    :data:`MIN_FP8_DIM`. With ``min_speedup > 0`` the GEMM must also be predicted at least that much faster
    in FP8 (:func:`gem_precision.roofline.fp8_gemm_speedup` on ``device``'s rates; ``a_t`` / ``b_t``: that
    operand is cast column-wise, ``precise``: no fast accumulation, ``b_cached``: B's cast is made ahead).
    """
    if n % FP8_ALIGN:
        return f"N={n} is not a multiple of {FP8_ALIGN}"
    if m < MIN_FP8_DIM or k < MIN_FP8_DIM:
        return f"M={m} or K={k} is below {MIN_FP8_DIM}"
    if min_speedup > 0:
        rates = rates_for(device)
        s = fp8_gemm_speedup(m, k, n, a_col=a_t, b_col=b_t, precise=precise, rates=rates, b_cached=b_cached)
        if s < min_speedup:
            return f"the {rates.name} roofline predicts {s:.2f}x for M={m}, K={k}, N={n} (< {min_speedup})"
    return None


def quantize_rowwise(
    x: torch.Tensor,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    transpose: bool = False,
    k_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 quantization of ``x [R, C]``, or of ``x.T`` (without materializing it) if ``transpose``.

    Args:
        k_multiple: zero-pad the data's last dimension (the K of the GEMM it feeds) to a multiple of this;
            zeros add nothing to a product, so a padded GEMM equals the unpadded one.

    Returns:
        ``(data, scale)``: data ``[R, C']`` (``[C, R']`` with ``transpose``; ``'`` = rounded up to
        ``k_multiple``), contiguous, ``elem_dtype``; scale ``[rows, 1]`` fp32.
    """
    check_float_tensor("quantize_rowwise", "x", x)
    if x.dim() != 2:
        raise ValueError(f"quantize_rowwise needs a 2-D tensor, got shape {tuple(x.shape)}")
    if k_multiple < 1:
        raise ValueError(f"quantize_rowwise: k_multiple must be >= 1, got {k_multiple}")
    if use_triton(x):
        from gem_precision.rowwise import triton as triton_rowwise

        return triton_rowwise.quantize_rowwise_triton(
            x, elem_format(elem_dtype), transpose=transpose, k_multiple=k_multiple
        )
    data, scale = quantize_rowwise_reference(x.t() if transpose else x, elem_dtype)
    pad = -data.shape[1] % k_multiple
    if pad:
        # F.pad has no FP8 kernels: pad the bytes.
        data = torch.nn.functional.pad(data.view(torch.uint8), (0, pad)).view(elem_dtype)
    return data, scale


def quantize_rowwise_both(
    x: torch.Tensor,
    row_dtype: torch.dtype = torch.float8_e4m3fn,
    col_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    row_k_multiple: int = 1,
    col_k_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both row-wise copies of ``x [R, C]``: of ``x`` and of ``x.T``, from one pass over ``x`` on CUDA.

    The backward of a linear layer quantizes the output gradient ``dy`` along N (its dgrad GEMM's K) and
    along the tokens (its wgrad GEMM's K); on CUDA one Triton pass finds both sets of maxima and one more
    writes both copies (two reads of ``x`` instead of four).

    Returns:
        ``(row_data [R, C'] row_dtype, row_scale [R, 1], colt_data [C, R'] col_dtype, col_scale [C, 1])``,
        each equal to :func:`quantize_rowwise` of ``x`` (``k_multiple=row_k_multiple``) and of ``x`` with
        ``transpose=True`` (``k_multiple=col_k_multiple``).
    """
    check_float_tensor("quantize_rowwise_both", "x", x)
    if x.dim() != 2:
        raise ValueError(f"quantize_rowwise_both needs a 2-D tensor, got shape {tuple(x.shape)}")
    if row_k_multiple < 1 or col_k_multiple < 1:
        raise ValueError(
            f"quantize_rowwise_both: k multiples must be >= 1, got {row_k_multiple}, {col_k_multiple}"
        )
    if use_triton(x):
        from gem_precision.rowwise import triton as triton_rowwise

        colt, cs, row, rs = triton_rowwise.quantize_tiles_triton(
            x,
            elem_format(col_dtype),
            col_k_multiple=col_k_multiple,
            row_fmt=elem_format(row_dtype),
            row_k_multiple=row_k_multiple,
        )
        assert row is not None and rs is not None
        return row, rs, colt, cs
    row, rs = quantize_rowwise(x, row_dtype, k_multiple=row_k_multiple)
    colt, cs = quantize_rowwise(x, col_dtype, transpose=True, k_multiple=col_k_multiple)
    return row, rs, colt, cs


def _scaled_mm_supported(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 9)


def scaled_mm_rowwise(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale).T`` for row-wise quantized ``a [M, K]`` and ``b [N, K]``.

    Args:
        a: ``[M, K]`` FP8, row-major. a_scale: ``[M, 1]`` fp32.
        b: ``[N, K]`` FP8, row-major (passed to ``torch._scaled_mm`` as the column-major ``b.T``).
        b_scale: ``[N, 1]`` fp32.

    Returns:
        ``[M, N]`` of ``out_dtype``. On CUDA sm89+ through ``torch._scaled_mm`` (K and N must be multiples
        of 16: pad K with ``quantize_rowwise(k_multiple=16)``); elsewhere emulated in fp32.
    """
    if _scaled_mm_supported(a):
        k, n = a.shape[1], b.shape[0]
        if k % 16 or n % 16:
            raise ValueError(f"fp8_rowwise on CUDA needs K and N divisible by 16, got K={k}, N={n}")
        return torch._scaled_mm(
            a,
            b.t(),
            scale_a=a_scale,
            scale_b=b_scale.reshape(1, -1),
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
        )
    return ((a.to(torch.float32) * a_scale) @ (b.to(torch.float32) * b_scale).t()).to(out_dtype)


def speedup_arg(min_speedup: float | str) -> str:
    """The custom ops' form of ``min_speedup``: a string, so that ``torch.compile`` keeps it a constant (a
    float read inside a traced ``autograd.Function`` becomes a symbolic input that dynamo fails to lift;
    :class:`~gem_precision.MXFP8Linear` passes the string it made when its recipe was set)."""
    return min_speedup if isinstance(min_speedup, str) else repr(float(min_speedup))


def fp8_rowwise_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    a_t: bool = False,
    b_t: bool = False,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    b_elem_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
    min_speedup: float | str = 0.0,
    b_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``A @ B.T`` with ``A = a.T if a_t else a`` (``[M, K]``) and ``B = b.T if b_t else b`` (``[N, K]``),
    both quantized to FP8 per row along K (the quantizer transposes on the fly and zero-pads K to a
    multiple of 16). A shape the FP8 path does not take (:func:`rowwise_fallback`, with ``min_speedup``:
    also a GEMM the roofline does not predict at least that much faster in FP8) is computed unquantized in
    ``out_dtype`` instead, decided per call. Not differentiable (:class:`~gem_precision.MXFP8Linear` is).

    ``b_quantized``: B's FP8 copy made ahead, ``quantize_rowwise(b, b_elem_dtype, transpose=b_t,
    k_multiple=16)`` exactly (a cached weight cast, :mod:`gem_precision.weight_cache`): used instead of
    casting ``b`` when the GEMM runs in FP8; ``b`` itself still serves the unquantized fallback.

    The GEMM is the custom op ``gem_precision::fp8_rowwise_mm``: ``torch.compile`` sees one opaque node
    with a fake implementation, so the shape decisions happen at run time and add no guards.

    Returns:
        ``[M, N]`` of ``out_dtype``.
    """
    for name, t in (("a", a), ("b", b)):
        check_float_tensor("fp8_rowwise_mm", name, t)
        if t.dim() != 2:
            raise ValueError(f"fp8_rowwise_mm: {name} must be 2-D, got shape {tuple(t.shape)}")
    k = a.shape[0] if a_t else a.shape[1]
    kb = b.shape[0] if b_t else b.shape[1]
    if k != kb:
        # Name the operands as they were passed (not the transposes computed here).
        ka = f"a.shape[{0 if a_t else 1}]" + (" (a_t=True)" if a_t else "")
        kbn = f"b.shape[{0 if b_t else 1}]" + (" (b_t=True)" if b_t else "")
        raise ValueError(
            f"fp8_rowwise_mm: K differs: a has shape {tuple(a.shape)} and b has shape {tuple(b.shape)}; "
            f"{ka} = {k} but {kbn} = {kb}"
        )
    qb, sb = b_quantized if b_quantized is not None else (None, None)
    out: torch.Tensor = torch.ops.gem_precision.fp8_rowwise_mm(
        a, b, a_t, b_t, elem_dtype, b_elem_dtype or elem_dtype, out_dtype, use_fast_accum,
        speedup_arg(min_speedup), qb, sb,
    )  # fmt: skip
    return out


def _mm_impl(
    a: torch.Tensor,
    b: torch.Tensor,
    a_t: bool,
    b_t: bool,
    elem_dtype: torch.dtype,
    b_elem_dtype: torch.dtype,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    min_speedup: float = 0.0,
    qb: torch.Tensor | None = None,
    sb: torch.Tensor | None = None,
) -> torch.Tensor:
    """The body of ``gem_precision::fp8_rowwise_mm`` (see :func:`fp8_rowwise_mm`)."""
    m, k = (a.shape[1], a.shape[0]) if a_t else (a.shape[0], a.shape[1])
    n = b.shape[1] if b_t else b.shape[0]
    if k == 0 or m == 0 or n == 0:  # an empty sum (e.g. wgrad of an empty batch) or an empty result
        return torch.zeros((m, n), dtype=out_dtype, device=a.device)
    why = rowwise_fallback(
        m, k, n, min_speedup=min_speedup, a_t=a_t, b_t=b_t, precise=not use_fast_accum, device=a.device,
        b_cached=qb is not None,
    )  # fmt: skip
    if why is not None:
        aa = a.t() if a_t else a
        bb = b.t() if b_t else b
        return aa.to(out_dtype) @ bb.to(out_dtype).t()
    qa, sa = quantize_rowwise(a, elem_dtype, transpose=a_t, k_multiple=FP8_ALIGN)
    if qb is None or sb is None:
        qb, sb = quantize_rowwise(b, b_elem_dtype, transpose=b_t, k_multiple=FP8_ALIGN)
    return scaled_mm_rowwise(qa, sa, qb, sb, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


@torch.library.custom_op("gem_precision::fp8_rowwise_mm", mutates_args=())
def _fp8_rowwise_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_t: bool,
    b_t: bool,
    elem_dtype: torch.dtype,
    b_elem_dtype: torch.dtype,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    min_speedup: str,
    qb: torch.Tensor | None,
    sb: torch.Tensor | None,
) -> torch.Tensor:
    return _mm_impl(
        a, b, a_t, b_t, elem_dtype, b_elem_dtype, out_dtype, use_fast_accum, float(min_speedup), qb, sb
    )


@_fp8_rowwise_mm_op.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    a_t: bool,
    b_t: bool,
    elem_dtype: torch.dtype,
    b_elem_dtype: torch.dtype,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    min_speedup: str,
    qb: torch.Tensor | None,
    sb: torch.Tensor | None,
) -> torch.Tensor:
    m = a.shape[1] if a_t else a.shape[0]
    n = b.shape[1] if b_t else b.shape[0]
    return a.new_empty((m, n), dtype=out_dtype)


def fp8_rowwise_dgrad_wgrad(
    dy: torch.Tensor,
    w: torch.Tensor,
    x: torch.Tensor,
    *,
    grad_elem_dtype: torch.dtype = torch.float8_e4m3fn,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = True,
    min_speedup: float | str = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both backward GEMMs of ``y = x @ w.T`` in FP8 row-wise: ``dx = dy @ w`` and ``dw = dy.T @ x``.

    Equal to two :func:`fp8_rowwise_mm` calls (``(dy, w, b_t=True)`` and ``(dy, x, a_t=True, b_t=True)``,
    each with its own fallback and ``min_speedup``), but ``dy`` is read once for both of its FP8 copies when
    both GEMMs take FP8 (:func:`quantize_rowwise_both`). The custom op
    ``gem_precision::fp8_rowwise_dgrad_wgrad`` (opaque to ``torch.compile``).

    Args:
        dy: ``[M, N]`` output gradient. w: ``[N, K]`` weight. x: ``[M, K]`` input.

    Returns:
        ``(dx [M, K], dw [N, K])`` of ``out_dtype``.
    """
    for name, t in (("dy", dy), ("w", w), ("x", x)):
        check_float_tensor("fp8_rowwise_dgrad_wgrad", name, t)
        if t.dim() != 2:
            raise ValueError(f"fp8_rowwise_dgrad_wgrad: {name} must be 2-D, got shape {tuple(t.shape)}")
    (m, n), k = dy.shape, w.shape[1]
    if w.shape[0] != n or x.shape != (m, k):
        raise ValueError(
            f"fp8_rowwise_dgrad_wgrad: shapes dy {tuple(dy.shape)}, w {tuple(w.shape)}, x {tuple(x.shape)} "
            "are not dy [M, N], w [N, K], x [M, K]"
        )
    dx, dw = torch.ops.gem_precision.fp8_rowwise_dgrad_wgrad(
        dy, w, x, grad_elem_dtype, elem_dtype, out_dtype, use_fast_accum, speedup_arg(min_speedup)
    )
    return dx, dw


@torch.library.custom_op("gem_precision::fp8_rowwise_dgrad_wgrad", mutates_args=())
def _dgrad_wgrad_op(
    dy: torch.Tensor,
    w: torch.Tensor,
    x: torch.Tensor,
    grad_elem_dtype: torch.dtype,
    elem_dtype: torch.dtype,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    min_speedup: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    (m, n), k = dy.shape, w.shape[1]
    # dgrad [M, N] @ [N, K] (K of the GEMM: N); wgrad [N, M] @ [M, K] (K of the GEMM: the M tokens).
    p, dev, speedup = not use_fast_accum, dy.device, float(min_speedup)
    both = (
        min(m, n, k) > 0
        and rowwise_fallback(m, n, k, min_speedup=speedup, b_t=True, precise=p, device=dev) is None
        and rowwise_fallback(n, m, k, min_speedup=speedup, a_t=True, b_t=True, precise=p, device=dev) is None
    )
    if not both:
        args = (grad_elem_dtype, elem_dtype, out_dtype, use_fast_accum, speedup)
        return _mm_impl(dy, w, False, True, *args), _mm_impl(dy, x, True, True, *args)
    qdy, sdy, qdyt, sdyt = quantize_rowwise_both(
        dy, grad_elem_dtype, grad_elem_dtype, row_k_multiple=FP8_ALIGN, col_k_multiple=FP8_ALIGN
    )
    qwt, swt = quantize_rowwise(w, elem_dtype, transpose=True, k_multiple=FP8_ALIGN)
    qxt, sxt = quantize_rowwise(x, elem_dtype, transpose=True, k_multiple=FP8_ALIGN)
    dx = scaled_mm_rowwise(qdy, sdy, qwt, swt, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    dw = scaled_mm_rowwise(qdyt, sdyt, qxt, sxt, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return dx, dw


@_dgrad_wgrad_op.register_fake
def _(
    dy: torch.Tensor,
    w: torch.Tensor,
    x: torch.Tensor,
    grad_elem_dtype: torch.dtype,
    elem_dtype: torch.dtype,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    min_speedup: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return dy.new_empty((dy.shape[0], w.shape[1]), dtype=out_dtype), w.new_empty(w.shape, dtype=out_dtype)
