"""Runs the persistent attention kernels under ``TRITON_INTERPRET=1`` on small cases; prints JSON.

Launched in a subprocess by ``test_attention_persistent_interpreter.py``; reuses
:func:`attention_interpreter_cases.run_case` (errors of the output and the three gradients against the
fp64 reference, and of the reference run in the case's dtype) and adds which kernel paths ran (TMA
descriptors or pointer loads), from :func:`gem_kernels.attention.testing.persistent_launches`.

Usage: ``TRITON_INTERPRET=1 python attention_persistent_cases.py [--quick]`` (``--quick``: the cases of
:data:`QUICK` only, for the fast CI test; the full list runs in the ``slow`` one).
"""

from __future__ import annotations

import json
import sys

import torch
from attention_interpreter_cases import SELF_LENGTHS, run_case  # raises SystemExit unless interpreted

from gem_kernels.attention import testing

F32, F16 = torch.float32, torch.float16
CROSS_Q, CROSS_KV = [40, 3, 0, 33], [5, 0, 9, 1]
PMA_Q, PMA_KV = [4, 1, 7, 0], [70, 35, 0, 12]


def cases():
    """(name, variant, act, q lengths, kv lengths or None, causal, window, dtype, d, dv, blocks, strided)."""
    out = []
    for variant in ("tma",):
        for act in ("softmax", "silu"):
            for mname, causal, window in (("none", False, None), ("causal", True, None)):
                out.append(
                    (
                        f"{variant}-self-{act}-{mname}",
                        variant,
                        act,
                        SELF_LENGTHS,
                        None,
                        causal,
                        window,
                        F32,
                        16,
                        16,
                        (32, 32),
                        False,
                    )
                )
        out.append(
            (
                f"{variant}-self-gelu-window",
                variant,
                "gelu",
                SELF_LENGTHS,
                None,
                False,
                (5, 3),
                F32,
                16,
                16,
                (32, 32),
                False,
            )
        )
        out.append(
            (
                f"{variant}-cross-softmax",
                variant,
                "softmax",
                CROSS_Q,
                CROSS_KV,
                False,
                None,
                F32,
                16,
                16,
                (32, 32),
                False,
            )
        )
        out.append(
            (f"{variant}-pma-silu", variant, "silu", PMA_Q, PMA_KV, False, None, F32, 16, 16, (32, 32), False)
        )
    # Asymmetric tiles, a causal window, fp16.
    out += [
        (
            "tma-blocks16x32-softmax-causal_window",
            "tma",
            "softmax",
            SELF_LENGTHS,
            None,
            True,
            (9, 7),
            F32,
            16,
            16,
            (16, 32),
            False,
        ),
        (
            "tma-blocks32x16-silu-causal",
            "tma",
            "silu",
            SELF_LENGTHS,
            None,
            True,
            None,
            F32,
            16,
            16,
            (32, 16),
            False,
        ),
        (
            "tma-fp16-softmax-causal",
            "tma",
            "softmax",
            SELF_LENGTHS,
            None,
            True,
            None,
            F16,
            16,
            16,
            (32, 32),
            False,
        ),
        # Layouts TMA cannot address (head dims not powers of two; strided heads): pointer loads instead.
        (
            "tma-dims24x8-softmax-causal",
            "tma",
            "softmax",
            [19, 0, 45],
            None,
            True,
            None,
            F32,
            24,
            8,
            (32, 32),
            False,
        ),
        (
            "tma-strided-silu-cross",
            "tma",
            "silu",
            CROSS_Q,
            CROSS_KV,
            False,
            None,
            F32,
            16,
            16,
            (32, 32),
            True,
        ),
    ]
    return out


# One case per path and shape class: TMA kernels on causal self-attention, cross, PMA and fp16, and a
# layout that falls back to pointer loads.
QUICK = (
    "tma-self-softmax-causal",
    "tma-self-silu-none",
    "tma-cross-softmax",
    "tma-pma-silu",
    "tma-fp16-softmax-causal",
    "tma-dims24x8-softmax-causal",
)


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    results = []
    for name, variant, act, lq, lk, causal, window, dtype, d, dv, blocks, strided in cases():
        if quick and name not in QUICK:
            continue
        before = testing.persistent_launches()
        r = run_case(
            name,
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
            strided=strided,
        )
        after = testing.persistent_launches()
        r["launches"] = {
            f"{k[0]}:{k[1]}": n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)
        }
        results.append(r)
    print("JSON:" + json.dumps(results))


if __name__ == "__main__":
    main()
