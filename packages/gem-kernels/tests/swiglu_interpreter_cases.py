"""Runs the fused SwiGLU backward kernel under ``TRITON_INTERPRET=1``.

Started as a subprocess by ``test_swiglu.py`` (the interpreter must be on before triton is imported). Each
case runs :func:`gem_kernels.swiglu_ffn` with the backend forced to ``triton``, forward and backward, on
fresh random inputs, and compares the output and the three gradients with the fp64 reference; the error of
the plain composition run in the same dtype is reported alongside, as the yardstick. Ragged shapes: M of
0, 1 and not a multiple of the 16-row block; H and K not multiples of the 16-wide blocks (K = 24 takes the
masked K loop), with the gate/up loads before and after the K loop. Prints ``JSON:`` and a list of results.
"""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

import gem_kernels.swiglu.triton as st  # noqa: E402
from gem_kernels import swiglu_ffn  # noqa: E402
from gem_kernels.swiglu.reference import swiglu_ffn_reference  # noqa: E402

LAUNCHES = {"n": 0}
_kernel = st.swiglu_backward_triton


def _counted(*args, **kwargs):
    LAUNCHES["n"] += 1
    return _kernel(*args, **kwargs)


st.swiglu_backward_triton = _counted


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(dy.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def main() -> None:
    results = []
    cases = [  # (lead shape of x, d, H, d_out)
        ((0,), 16, 16, 16),
        ((1,), 16, 16, 16),
        ((37,), 32, 48, 16),
        ((3, 11), 24, 24, 40),  # K = 24: masked K loop; H = 24, d_out = 40: partial column tiles
        ((70,), 48, 40, 32),
        ((45,), 32, 32, 24),  # persistent (odd seed): 6 tiles over 3 programs; K = 24 read past its end as 0
    ]
    for seed, (lead, d, hidden, d_out) in enumerate(cases):
        for dtype in (torch.float32, torch.float16):  # the interpreter's bf16 tl.dot is wrong (GPU tests)
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(*lead, d, generator=g)
            w13 = torch.randn(2 * hidden, d, generator=g) / d**0.5
            w2 = torch.randn(d_out, hidden, generator=g) / hidden**0.5
            dy = torch.randn(*lead, d_out, generator=g)
            inputs = [t.to(dtype) for t in (x, w13, w2)]
            # fp32 cases take the interpreter's default tiles (pointer loads, gate/up prefetched), fp16 ones
            # the same tiles through tensor descriptors with gate/up loaded after the K loop, alternately one
            # program per tile and the persistent kernel (3 programs looping over the tiles). Descriptors run
            # only where H is a multiple of 16 and rows are 16-byte aligned: else pointers.
            fp16 = "16,16,16,2,1,1,0,1" + (",1" if seed % 2 else "")
            os.environ[st.BLOCKS_ENV] = "" if dtype == torch.float32 else fp16
            before = LAUNCHES["n"]
            paths_before = dict(st.launches)
            got = _grads(lambda *a: swiglu_ffn(*a, backend="triton"), inputs, dy)
            launched = LAUNCHES["n"] - before
            paths = {
                k: v - paths_before.get(k, 0) for k, v in st.launches.items() if v - paths_before.get(k, 0)
            }
            same = _grads(swiglu_ffn_reference, inputs, dy)
            exact = _grads(swiglu_ffn_reference, [t.double() for t in inputs], dy.double())
            m = x.numel() // d
            results.append({
                "name": f"M={m} d={d} H={hidden} d_out={d_out}",
                "dtype": str(dtype),
                "err": [_rel(a, e) if e.numel() else 0.0 for a, e in zip(got, exact)],
                "ref_err": [_rel(a, e) if e.numel() else 0.0 for a, e in zip(same, exact)],
                "finite": all(bool(t.isfinite().all()) for t in got),
                "dtypes": [str(t.dtype) for t in got],
                "launched": launched,
                "paths": paths,
                "seed": seed,
                "H": hidden,
                "M": m,
            })  # fmt: skip
    print("JSON:" + json.dumps(results))


if __name__ == "__main__":
    main()
