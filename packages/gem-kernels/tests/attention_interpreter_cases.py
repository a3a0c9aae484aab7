"""Runs the attention Triton kernels under ``TRITON_INTERPRET=1`` on many small cases; prints JSON.

Launched in a subprocess by ``test_attention_triton_interpreter.py`` (the interpreter must be switched on
before triton is first imported, which a pytest process cannot guarantee). For every case it prints the
relative Frobenius errors of the kernel's output and of its three gradients against the fp64 reference,
and the same errors of the reference run in the case's dtype (the bound the test scales).

Usage: ``TRITON_INTERPRET=1 python attention_interpreter_cases.py [--split]`` (``--split``: only the cases
of the split one-tile backward, :func:`split_cases`).
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("run with TRITON_INTERPRET=1")

import torch

from gem_kernels import gdpa, jagged_flash_attention, use_backend
from gem_kernels.attention import testing

ACTS = ("softmax", "silu", "gelu", "relu", "relu2", "identity")
SELF_MASKS = {
    "none": (False, None),
    "causal": (True, None),
    "window": (False, (5, 3)),
    "causal_window": (True, (9, 7)),
}
# Lengths: empty, 1, non-multiples of every block size, and several tiles (64 = two 32-tiles exactly).
SELF_LENGTHS = [37, 0, 1, 70, 16, 64]


def _offsets(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _call(act, q, k, v, qo, ko, max_q, max_k, causal, window):
    if act == "softmax":
        return jagged_flash_attention(
            q, k, v, qo, ko, max_q_len=max_q, max_kv_len=max_k, causal=causal, window=window
        )
    return gdpa(
        q, k, v, qo, ko, max_q_len=max_q, max_kv_len=max_k, activation=act, causal=causal, window=window
    )


def _padded(t):
    """A copy of ``t`` ``[T, H, d]`` inside a ``[T, H, d + 5]`` buffer (the caller slices it back)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 5, dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide


def _rel(a, b):
    b = b.double()
    n = b.norm().item()
    return (a.double() - b).norm().item() / (n if n > 0 else 1.0)


def run_case(
    name,
    act,
    lq,
    lk,
    causal,
    window,
    dtype,
    d=16,
    dv=16,
    blocks=(32, 32),
    seed=0,
    offsets_dtype=torch.int32,
    variant="onetile",
    strided=False,
    chunk=None,
):
    g = torch.Generator().manual_seed(seed)
    cross = lk is not None
    lk_ = lk if cross else lq
    h = 2
    q64 = torch.randn(sum(lq), h, d, generator=g, dtype=torch.float64)
    k64 = torch.randn(sum(lk_), h, d, generator=g, dtype=torch.float64)
    v64 = torch.randn(sum(lk_), h, dv, generator=g, dtype=torch.float64)
    # Quantize the inputs first, so that every error below is computation error alone.
    q64, k64, v64 = (t.to(dtype).double() for t in (q64, k64, v64))
    qo = _offsets(lq, offsets_dtype)
    ko = _offsets(lk_, offsets_dtype) if cross else None
    mq, mk = max(lq), (max(lk_) if cross else None)
    dout = torch.randn(sum(lq), h, dv, generator=g, dtype=torch.float64).to(dtype)

    def grads(q, k, v, backend, blocks_=None, strided_=False):
        # strided_: the op gets views whose rows and heads are padded apart (unit stride in the last dim).
        leaves = [_padded(t) if strided_ else t.detach().clone() for t in (q, k, v)]
        for t in leaves:
            t.requires_grad_(True)
        args = [t[..., : x.shape[-1]] for t, x in zip(leaves, (q, k, v))]
        with use_backend(backend), testing.forced(variant=variant, blocks=blocks_, chunk=chunk):
            out = _call(act, *args, qo, ko, mq, mk, causal, window)
            out.backward(dout.to(out.dtype))
        return (out, *(t.grad[..., : x.shape[-1]] for t, x in zip(leaves, (q, k, v))))

    ref = grads(q64, k64, v64, "reference")
    low = tuple(t.to(dtype) for t in (q64, k64, v64))
    ref_low = grads(*low, "reference")
    tri = grads(*low, "triton", blocks, strided)
    finite = all(bool(torch.isfinite(t).all()) for t in tri)
    # Queries whose key sequence is empty must output exactly 0 with zero gradient.
    empty_rows_zero = True
    if cross:
        qo_l = qo.tolist()
        for b, n in enumerate(lk_):
            if n == 0:
                rows = slice(qo_l[b], qo_l[b + 1])
                empty_rows_zero &= bool((tri[0][rows] == 0).all()) and bool((tri[1][rows] == 0).all())
    return {
        "name": name,
        "err": [_rel(a, b) for a, b in zip(tri, ref)],
        "ref_err": [_rel(a, b) for a, b in zip(ref_low, ref)],
        "finite": finite,
        "empty_rows_zero": empty_rows_zero,
        "dtype": str(dtype),
    }


def cases():
    out = []
    for act in ACTS:
        for mname, (causal, window) in SELF_MASKS.items():
            out.append((f"self-{act}-{mname}", act, SELF_LENGTHS, None, causal, window, torch.float32))
    # Cross-attention, long queries / short keys (one key sequence empty), and PMA (few queries, long keys).
    for act in ("softmax", "silu", "gelu"):
        out.append((f"cross-{act}", act, [40, 3, 0, 33], [5, 0, 9, 1], False, None, torch.float32))
        out.append((f"pma-{act}", act, [4, 1, 7, 0], [70, 35, 0, 12], False, None, torch.float32))
    # Short self-attention (longest sequence <= 64: the one-tile kernels, with band masks).
    for act in ("softmax", "silu"):
        out.append(
            (f"short-self-{act}-causal_window", act, [20, 0, 1, 33, 64], None, True, (9, 7), torch.float32)
        )
        out.append((f"short-self-{act}-window", act, [20, 0, 1, 33, 64], None, False, (4, 11), torch.float32))
    out.append(("cross-long-kv-relu2", "relu2", [70, 3, 0, 33], [64, 0, 40, 1], False, None, torch.float32))
    out.append(("pma-32q-identity", "identity", [32, 1, 17, 0], [70, 35, 0, 12], False, None, torch.float32))
    # fp16 inputs (bf16 arithmetic is wrong in the interpreter; bf16 is tested on the GPU).
    for act in ("softmax", "silu"):
        out.append((f"fp16-self-{act}-causal", act, SELF_LENGTHS, None, True, None, torch.float16))
        out.append((f"fp16-cross-{act}", act, [40, 3, 0, 33], [5, 0, 9, 1], False, None, torch.float16))
    return out


def block_cases():
    """Asymmetric and head-dim-padding cases: other tile shapes, D and Dv not powers of two."""
    return [
        (
            "blocks16x32-softmax-window",
            "softmax",
            SELF_LENGTHS,
            None,
            False,
            (20, 2),
            torch.float32,
            16,
            16,
            (16, 32),
        ),
        ("blocks32x16-silu-causal", "silu", SELF_LENGTHS, None, True, None, torch.float32, 16, 16, (32, 16)),
        (
            "blocks64x16-gelu-cross",
            "gelu",
            [40, 3, 0, 33],
            [5, 0, 9, 1],
            False,
            None,
            torch.float32,
            16,
            16,
            (64, 16),
        ),
        ("dims24x8-softmax-causal", "softmax", [19, 0, 45], None, True, None, torch.float32, 24, 8, (32, 32)),
        (
            "dims12x40-relu2-window",
            "relu2",
            [19, 0, 45],
            None,
            False,
            (4, 0),
            torch.float32,
            12,
            40,
            (32, 32),
        ),
    ]


def edge_cases():
    """Band and offsets edge cases: diagonal-only and very wide windows, int64 offsets."""
    return [
        ("window0x0-silu", "silu", SELF_LENGTHS, None, False, (0, 0), torch.int32),
        ("window1000x2-softmax", "softmax", SELF_LENGTHS, None, False, (1000, 2), torch.int32),
        ("int64-offsets-softmax-causal", "softmax", SELF_LENGTHS, None, True, None, torch.int64),
        ("int64-offsets-relu-cross", "relu", [40, 3, 0, 33], [5, 0, 9, 1], False, None, torch.int64),
    ]


def split_cases():
    """The split one-tile backward (``onetile_split``) with small chunks, so that sequences span several:
    (name, act, q lengths, kv lengths or None, causal, window, dtype, chunk rows). Blocks are 32x32 (the
    streamed tile is 32 rows): chunks of 32 are one tile, 48 and 24 are not a whole number of tiles. Lengths
    0 and 1, one chunk exactly, several chunks with a partial last one, an empty key (cross) or query (PMA)
    sequence beside a long other side."""
    cross_q, cross_kv = [70, 3, 0, 33, 1, 100, 32], [5, 0, 9, 1, 16, 12, 7]
    pma_q, pma_kv = [4, 1, 7, 0, 32, 5], [70, 35, 0, 12, 130, 32]
    short_self = [20, 0, 1, 33, 64]
    return [
        ("split-cross-softmax-chunk32", "softmax", cross_q, cross_kv, False, None, torch.float32, 32),
        ("split-cross-silu-chunk48", "silu", cross_q, cross_kv, False, None, torch.float32, 48),
        (
            "split-cross-long-kv-gelu-chunk32",
            "gelu",
            [70, 3, 0, 40],
            [64, 0, 40, 1],
            False,
            None,
            torch.float32,
            32,
        ),
        ("split-cross-whole-chunk-relu2", "relu2", cross_q, cross_kv, False, None, torch.float32, 128),
        ("split-pma-softmax-chunk32", "softmax", pma_q, pma_kv, False, None, torch.float32, 32),
        ("split-pma-silu-chunk40", "silu", pma_q, pma_kv, False, None, torch.float32, 40),
        (
            "split-short-self-softmax-causal_window-chunk32",
            "softmax",
            short_self,
            None,
            True,
            (9, 7),
            torch.float32,
            32,
        ),
        ("split-short-self-silu-window-chunk24", "silu", short_self, None, False, (4, 11), torch.float32, 24),
        ("split-fp16-cross-softmax-chunk32", "softmax", cross_q, cross_kv, False, None, torch.float16, 32),
        ("split-fp16-pma-silu-chunk48", "silu", pma_q, pma_kv, False, None, torch.float16, 48),
    ]


def main() -> None:
    if sys.argv[1:] == ["--split"]:
        results = [
            run_case(name, act, lq, lk, causal, window, dtype, variant="onetile_split", chunk=chunk)
            for name, act, lq, lk, causal, window, dtype, chunk in split_cases()
        ]
        # Strided inputs and int64 offsets through the split kernels and their schedule.
        lq, lk = [70, 3, 0, 33], [5, 0, 9, 1]
        for name, kwargs in [
            ("strided", dict(strided=True)),
            ("int64-offsets", dict(offsets_dtype=torch.int64)),
        ]:
            for what, (lq_, lk_) in [("cross", (lq, lk)), ("pma", ([4, 1, 7, 0], [70, 35, 0, 12]))]:
                results.append(
                    run_case(
                        f"split-{name}-{what}-silu-chunk32",
                        "silu",
                        lq_,
                        lk_,
                        False,
                        None,
                        torch.float32,
                        variant="onetile_split",
                        chunk=32,
                        **kwargs,
                    )
                )
        print("JSON:" + json.dumps(results))
        return
    results = []
    for name, act, lq, lk, causal, window, dtype in cases():
        results.append(run_case(name, act, lq, lk, causal, window, dtype))
        if name.startswith(("cross", "pma", "short", "fp16-cross")):
            # The asymmetric classes also have the general tiled kernels: check those too.
            results.append(run_case(name + "-tiled", act, lq, lk, causal, window, dtype, variant="tiled"))
    for name, act, lq, lk, causal, window, dtype, d, dv, blocks in block_cases():
        for variant in ("onetile", "tiled") if lk is not None else ("tiled",):
            results.append(
                run_case(
                    name + "-" + variant,
                    act,
                    lq,
                    lk,
                    causal,
                    window,
                    dtype,
                    d=d,
                    dv=dv,
                    blocks=blocks,
                    variant=variant,
                )
            )
    for name, act, lq, lk, causal, window, odt in edge_cases():
        results.append(run_case(name, act, lq, lk, causal, window, torch.float32, offsets_dtype=odt))
    # Strided (non-contiguous) q, k, v: the kernels read them in place.
    strided = (
        ("softmax-cross", "softmax", [40, 3, 0, 33], [5, 0, 9, 1]),
        ("silu-pma", "silu", [4, 1, 7, 0], [70, 35, 0, 12]),
    )
    for variant in ("tiled", "onetile"):
        for name, act, lq, lk in strided:
            results.append(
                run_case(
                    f"strided-{name}-{variant}",
                    act,
                    lq,
                    lk,
                    False,
                    None,
                    torch.float32,
                    variant=variant,
                    strided=True,
                )
            )
    results.append(
        run_case(
            "strided-gelu-self-causal", "gelu", SELF_LENGTHS, None, True, None, torch.float32, strided=True
        )
    )
    print("JSON:" + json.dumps(results))


if __name__ == "__main__":
    main()
