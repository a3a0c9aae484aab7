"""One "process" of the persistent-tuning test: attention through the autotuners under the interpreter.

Launched (twice, with the same ``GEM_KERNELS_CACHE``) by ``test_tune_cache.py``: it runs a causal fp16
softmax forward in the general shape class (two candidates) and a short-key cross GDPA forward (the
tiled-vs-one-tile choice), all through ``triton.autotune`` as on CUDA
(``testing.forced(tune_in_interpreter=True)``), and prints ``JSON:`` with how many candidates each tuner
timed, the variant choices, and the errors against the fp64 reference.

Usage: ``TRITON_INTERPRET=1 GEM_KERNELS_CACHE=DIR python tune_cache_cases.py``.
"""

from __future__ import annotations

import json
import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("run with TRITON_INTERPRET=1")

import torch

from gem_kernels import gdpa, jagged_flash_attention, use_backend
from gem_kernels.attention import testing


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    # Self-attention, longest 70 -> bucket 128: the general class. Lengths 0, 1 and a non-multiple.
    off = torch.tensor([0, 70, 70, 71], dtype=torch.int32)
    q, k, v = (torch.randn(71, 1, 16, generator=g).half() for _ in range(3))
    # Cross-attention with <= 16 keys: the short_kv class, where "auto" times tiled against one-tile.
    qo = torch.tensor([0, 9, 30], dtype=torch.int32)
    ko = torch.tensor([0, 5, 16], dtype=torch.int32)
    cq, ck, cv = (torch.randn(n, 1, 16, generator=g) for n in (30, 16, 16))
    with use_backend("triton"), testing.forced(variant="auto", tune_in_interpreter=True):
        out = jagged_flash_attention(q, k, v, off, max_q_len=70, causal=True)
        cross = gdpa(cq, ck, cv, qo, ko, max_q_len=21, max_kv_len=11)
    with use_backend("reference"):
        ref = jagged_flash_attention(q.double(), k.double(), v.double(), off, max_q_len=70, causal=True)
        cross_ref = gdpa(cq.double(), ck.double(), cv.double(), qo, ko, max_q_len=21, max_kv_len=11)
    tuners = {n: testing.autotuners()[n] for n in ("fwd", "fwd_short_kv")}
    result = {
        "timed": {n: t.persistent.timed for n, t in tuners.items()},
        "variants": sorted(testing.auto_choices().values()),
        "err": _rel(out, ref),
        "cross_err": _rel(cross, cross_ref),
        "files": sorted(os.listdir(os.path.join(os.environ["GEM_KERNELS_CACHE"], "v1"))),
    }
    print("JSON:" + json.dumps(result))


if __name__ == "__main__":
    main()
