"""Checks of the column-wise (transposed) and two-copy FP8 row-wise Triton kernels against the PyTorch
reference; run by test_rowwise_triton.py in a subprocess with TRITON_INTERPRET=1 on the CPU, and directly on
a GPU (``--big``). Prints one line per check; exits 1 on failure.

Bit for bit: every byte of a finite column (row) and every scale. A column holding Inf or NaN has an Inf or
NaN scale, as in the reference (its bytes are not compared: they dequantize to NaN whatever they are).
"""

from __future__ import annotations

import os
import sys

import torch

from gem_precision.formats import E4M3, E5M2, ElemFormat
from gem_precision.rowwise import triton as triton_rowwise
from gem_precision.rowwise.reference import quantize_rowwise_reference

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def reference(x: torch.Tensor, fmt: ElemFormat, k_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rowwise's PyTorch path (reference, then zero bytes up to a multiple of k_multiple), run on
    ``x``'s own device: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal, so the CUDA
    and CPU references can differ in a scale's last bit (measured on an H100, 2026-12-07)."""
    d, s = quantize_rowwise_reference(x, fmt.dtype)
    pad = -d.shape[1] % k_multiple
    return torch.nn.functional.pad(d.view(torch.uint8), (0, pad)).cpu(), s.cpu()


def same(
    name: str, got: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, fmt: ElemFormat, km: int
) -> None:
    """``got`` = (data, scale) of the row-wise quantization of ``x`` (already transposed if needed)."""
    rd, rs = reference(x, fmt, km)
    d, s = got[0].cpu(), got[1].cpu()
    fin = torch.isfinite(x.cpu()).all(1)
    ok = d.shape == rd.shape and d.dtype == fmt.dtype and s.shape == rs.shape and d.is_contiguous()
    ok = ok and torch.equal(d.view(torch.uint8)[fin], rd[fin])
    ok = ok and torch.equal(s[fin], rs[fin]) and torch.equal(s[~fin].isnan(), rs[~fin].isnan())
    ok = ok and torch.equal(s[~fin].isinf(), rs[~fin].isinf())
    check(name, ok, f"{tuple(x.shape)}")


def sample(r: int, c: int, seed: int, dtype: torch.dtype, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows and columns of very different magnitudes, so a wrong scale (row vs column, or another column's)
    # shows in the bytes.
    x = torch.randn(r, c, generator=g) * 4.0 ** torch.randint(-6, 7, (r, 1), generator=g)
    x = x * 2.0 ** torch.randint(-4, 5, (1, c), generator=g)
    if special and r > 3 and c > 3:
        x[:, 1] = 0.0  # an all-zero column: eps scale, zero bytes
        x[2, :] = -0.0  # an all-zero row
        x[1, 2] = float("inf")
        x[3, 3] = float("nan")
        x[0, 0] = 1e-40  # a subnormal
    return x.to(dtype).to(DEVICE)


def main(big: bool) -> None:
    shapes = [(70, 45), (1, 1), (1, 40), (37, 1), (129, 80), (16, 32), (5, 3)]
    if big:
        shapes += [(180_001, 512), (65_536, 4096), (12_345, 2048), (4097, 1536)]
    for impl in ("tiled", "legacy"):
        for r, c in shapes[:2] if impl == "legacy" else shapes:
            for dtype in (torch.float32, torch.bfloat16):
                # The legacy kernel loses a column's NaN in its amax (float max): compare it on finite data.
                x = sample(r, c, r * 7 + c, dtype, special=impl == "tiled")
                for km in (1, 16):
                    got = triton_rowwise.quantize_rowwise_triton(
                        x, E4M3, transpose=True, k_multiple=km, col_impl=impl
                    )
                    same(f"{impl} transpose {dtype} k_multiple={km}", got, x.t(), E4M3, km)
    for r, c in shapes:
        x = sample(r, c, r + c, torch.bfloat16, special=True)
        for col_fmt, row_fmt in ((E4M3, E4M3), (E5M2, E4M3)):
            for ckm, rkm in ((16, 16), (1, 16)) if col_fmt is E4M3 else ((16, 1),):
                ct, cs, rd, rs = triton_rowwise.quantize_tiles_triton(
                    x, col_fmt, col_k_multiple=ckm, row_fmt=row_fmt, row_k_multiple=rkm
                )
                assert rd is not None and rs is not None
                tag = f"both {col_fmt.dtype}/{row_fmt.dtype} k={ckm}/{rkm}"
                same(f"{tag} column copy", (ct, cs), x.t(), col_fmt, ckm)
                same(f"{tag} row copy", (rd, rs), x, row_fmt, rkm)
    # A strided (transposed) input: the loads follow its strides.
    x = sample(48, 70, 3, torch.float32, special=False).t()
    same("transpose of a non-contiguous view", triton_rowwise.quantize_rowwise_triton(
        x, E4M3, transpose=True, k_multiple=16), x.t(), E4M3, 16)  # fmt: skip
    ct, cs, rd, rs = triton_rowwise.quantize_tiles_triton(x, E4M3, col_k_multiple=16, row_fmt=E4M3)
    assert rd is not None and rs is not None
    same("both of a non-contiguous view: row copy", (rd, rs), x, E4M3, 1)
    # Empty inputs: shapes, zero padding, the reference's scales of empty rows.
    for r, c in ((0, 16), (16, 0), (0, 0)):
        x = torch.randn(r, c, device=DEVICE)
        same(
            f"transpose empty {r}x{c}",
            triton_rowwise.quantize_rowwise_triton(x, E4M3, transpose=True, k_multiple=16),
            x.t(),
            E4M3,
            16,
        )
        ct, cs, rd, rs = triton_rowwise.quantize_tiles_triton(
            x, E4M3, col_k_multiple=16, row_fmt=E4M3, row_k_multiple=16)  # fmt: skip
        assert rd is not None and rs is not None
        same(f"both empty {r}x{c} column copy", (ct, cs), x.t(), E4M3, 16)
        same(f"both empty {r}x{c} row copy", (rd, rs), x, E4M3, 16)
        same(
            f"row-wise empty {r}x{c}",
            triton_rowwise.quantize_rowwise_triton(x, E4M3, transpose=False),
            x,
            E4M3,
            1,
        )
    print("FAILED:", FAILED if FAILED else "none")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main(big="--big" in sys.argv)
