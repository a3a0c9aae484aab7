"""Checks of the packed-row kernels (``gem_precision.packed.triton``) against the PyTorch reference and
against the path they replace (``quantize_rowwise`` / ``to_mx`` then the scale bytes concatenated); run by
test_packed.py in a subprocess with TRITON_INTERPRET=1 on the CPU, and directly on a GPU (``--big``: the
shapes of a GEM trunk's weights). Prints one line per check; exits 1 on failure.

Every comparison is of bytes (``torch.equal`` on uint8 / on the output's bits): the kernels must give the
bytes of today's quantizer, not values close to them. Inputs are finite (weights): zeros, signed zeros,
fp32 subnormals, values at and around the FP8 range's edges, rows spanning 60 decades.
"""

from __future__ import annotations

import os
import sys

import torch

from gem_precision import quantize_rowwise, to_mx
from gem_precision.packed import dequantize_packed, packed_width, quantize_packed, quantize_packed_many
from gem_precision.packed.reference import dequantize_packed_reference, quantize_packed_reference

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def sample(r: int, c: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes, with zeros, subnormals and the FP8 range's edges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * 10.0 ** (torch.rand(r, 1, generator=g) * 60 - 30)
    x = x * 2.0 ** torch.randint(-3, 4, (1, c), generator=g)
    if r > 4 and c > 3:
        x[0] = 0.0  # an all-zero row
        x[1, : c // 2] = -0.0
        x[2, 0], x[2, 1], x[2, 2] = 1e-40, -3e-39, 448.0 * 2**-20  # subnormals beside a normal
        x[3, 0], x[3, 1] = 3.0e38, -1.5e38  # near fp32's max (finite)
        x[4] = torch.linspace(-448.0, 448.0, c)  # every rounding case of one scale
    return x.to(dtype).to(DEVICE)


def old_path(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What gem-parallel's all-gather sent before the fused kernel: the quantizer, then the bytes cat."""
    if fmt == "fp8":
        data, scale = quantize_rowwise(x, torch.float8_e4m3fn)
    else:
        mx = to_mx(x, axis=-1, block_size=32, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil")
        data, scale = mx.data, mx.scale
    scale_u8 = scale.contiguous().view(torch.uint8).reshape(x.shape[0], -1)
    return torch.cat([data.view(torch.uint8), scale_u8], dim=1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def check_many(fmt: str, big: bool) -> None:
    """One launch over a round of shards: each result equals the reference of its shard, whatever the
    shards' order in memory (later ones at lower addresses too), shapes, strides, dtypes and emptiness; a
    second round over the same shards (its launch tables kept) sees their new values."""
    shapes = [(96, 64), (17, 65), (1, 1), (0, 64), (3, 0), (40, 97), (33, 200)]
    if big:
        shapes += [(1536, 512), (512, 512), (4096, 512), (512, 2048), (256, 4104)]
    later = [sample(r, c, 7 * r + c, torch.float32) for r, c in shapes]  # allocated first: lower addresses
    xs = [sample(r, c, 3 * r + c, torch.float32) for r, c in shapes] + later[::-1]
    xs.append(sample(70, 48, 9, torch.float32).t())  # a transposed view
    xs.append(sample(21, 130, 10, torch.bfloat16))  # a second dtype: its own launch
    for round_ in (1, 2):
        got = quantize_packed_many(xs, fmt, backend="triton")
        ok = len(got) == len(xs)
        for x, g in zip(xs, got):
            ok = ok and g.shape == (x.shape[0], packed_width(x.shape[1], fmt)) and g.dtype == torch.uint8
            ok = ok and torch.equal(g.cpu(), quantize_packed_reference(x, fmt).cpu())
        check(f"pack many {fmt}, round {round_}: {len(xs)} shards = reference", ok)
        for x in xs[:3] + xs[-2:]:
            x.mul_(-0.5)  # in place, as an optimizer step: the same addresses, new (finite) values


def main(big: bool) -> None:
    shapes = [(1, 1), (5, 3), (17, 65), (33, 200), (16, 64), (7, 32), (40, 97)]
    if big:
        shapes += [(512, 512), (1536, 512), (4096, 512), (512, 2048), (8192, 1024), (1000, 4104), (3, 70_000)]
    for fmt in ("fp8", "mxfp8"):
        for r, c in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                x = sample(r, c, r * 31 + c, dtype)
                got = quantize_packed(x, fmt, backend="triton")
                # The reference on x's device: CUDA divides by a Python scalar through its reciprocal.
                ref = quantize_packed_reference(x, fmt).cpu()
                old = old_path(x, fmt)
                tag = f"{fmt} {r}x{c} {str(dtype)[6:]}"
                ok = got.shape == (r, packed_width(c, fmt)) and got.dtype == torch.uint8
                check(f"pack {tag} = reference", ok and torch.equal(got.cpu(), ref))
                check(f"pack {tag} = old path", ok and torch.equal(got.cpu(), old.cpu()))
                for odt in (torch.bfloat16, torch.float32):
                    w = dequantize_packed(got, c, fmt, odt, backend="triton")
                    wr = dequantize_packed_reference(ref, c, fmt, odt)
                    check(f"unpack {tag} -> {str(odt)[6:]} = reference", torch.equal(bits(w), bits(wr)))
        # Strided input (a transposed view) and a strided output buffer (written in place).
        x = sample(48, 70, 5, torch.float32).t()
        got = quantize_packed(x, fmt, backend="triton")
        check(
            f"pack {fmt} of a transposed view",
            torch.equal(got.cpu(), quantize_packed_reference(x, fmt).cpu()),
        )
        buf = torch.full((70, 48), 7.0, dtype=torch.bfloat16, device=DEVICE).t()  # [48, 70], strides (1, 48)
        x = sample(48, 70, 6, torch.float32)
        packed = quantize_packed(x, fmt, backend="triton")
        ret = dequantize_packed(packed, 70, fmt, out=buf, backend="triton")
        ref = dequantize_packed_reference(packed.cpu(), 70, fmt, torch.bfloat16)
        check(f"unpack {fmt} into a strided out", ret is buf and torch.equal(bits(buf), bits(ref)))
        # Empty shards: rows of scale bytes only, or no rows.
        for r, c in ((0, 64), (3, 0), (0, 0)):
            x = torch.zeros(r, c, device=DEVICE)
            got = quantize_packed(x, fmt, backend="triton")
            ok = got.shape == (r, packed_width(c, fmt))
            check(
                f"pack {fmt} empty {r}x{c}",
                ok and torch.equal(got.cpu(), quantize_packed_reference(x, fmt).cpu()),
            )
    for fmt in ("fp8", "mxfp8"):
        check_many(fmt, big)
    print("FAILED:", FAILED if FAILED else "none")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main(big="--big" in sys.argv)
