"""Runs the block-attention, rotary and jagged<->padded Triton kernels under ``TRITON_INTERPRET=1``.

Started as a subprocess by ``test_block_triton_interpreter.py`` (the interpreter must be on before
triton is imported). Every case goes through the public API with the backend forced to ``triton``,
forward and backward, and is compared with the fp64 reference; the error of the reference path run in
the same dtype is reported alongside, as the yardstick. Prints ``JSON:`` and a list of results.
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from gem_kernels import (  # noqa: E402
    Rotary,
    apply_rotary,
    block_attention,
    jagged_mean,
    jagged_to_padded,
    padded_to_jagged,
    use_backend,
)

LAUNCHES: dict[str, int] = {}


def _count_launches() -> None:
    """Wrap the kernel entry points so each case can prove that the Triton path ran (the dispatcher
    imports them at call time, so patching the module attributes is enough)."""
    import gem_kernels.block.triton as bt
    import gem_kernels.jagged.triton as jt
    import gem_kernels.rotary.triton as rt

    for module, name in ((bt, "block_attention_fwd"), (bt, "block_attention_bwd"), (rt, "rotary_triton"),
                         (jt, "jagged_to_padded_triton"), (jt, "padded_to_jagged_triton"),
                         (jt, "jagged_mean_triton")):  # fmt: skip
        fn = getattr(module, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            LAUNCHES[_name] = LAUNCHES.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(module, name, counted)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _run(fn, inputs, grad):
    """(outputs, input gradients) of fn with the given upstream gradient."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    return [out, *grads]


def _compare(name, dtype, fn, inputs, grad):
    LAUNCHES.clear()
    with use_backend("triton"):
        got = _run(fn, [t.to(dtype) for t in inputs], grad)
    launches = dict(LAUNCHES)
    exact = _run(fn, [t.double() for t in inputs], grad.double())
    same = _run(fn, [t.to(dtype) for t in inputs], grad)  # reference path, same dtype
    return {
        "name": name,
        "dtype": str(dtype),
        "err": [_rel(g, e) for g, e in zip(got, exact)],
        "ref_err": [_rel(s, e) for s, e in zip(same, exact)],
        "finite": all(bool(torch.isfinite(g).all()) for g in got),
        "dtypes_ok": all(g.dtype == dtype for g in got),
        "launches": launches,
    }


def block_cases(results):
    torch.manual_seed(0)
    lengths = [0, 1, 63, 64, 65, 130, 2]
    total = sum(lengths)
    offsets = _offsets(lengths)
    heads, d, dv = 2, 32, 16
    q, k = torch.randn(total, heads, d), torch.randn(total, heads, d)
    v, grad = torch.randn(total, heads, dv), torch.randn(total, heads, dv)
    rotaries = {
        "none": None,
        "default": Rotary(),
        # Real-valued positions (log time gaps), kept as fp64 to check the cast in the wrapper.
        "float": Rotary(torch.log1p(torch.rand(total, dtype=torch.float64) * 1e4) * 20, base=500.0),
    }
    for block_size in (32, 64, 128):
        for causal in (False, True):
            for rname, rotary in rotaries.items():
                dtypes = [torch.float32] + ([torch.float16] if block_size == 64 else [])
                for dtype in dtypes:

                    def fn(q, k, v, block_size=block_size, causal=causal, rotary=rotary):
                        return block_attention(q, k, v, offsets, max_seq_len=130, block_size=block_size,
                                               causal=causal, rotary=rotary)  # fmt: skip

                    name = f"block bs={block_size} causal={causal} rotary={rname}"
                    results.append(_compare(name, dtype, fn, [q, k, v], grad))

    # Many sequences (the binary search over 37 block starts), odd head dims, a block size that is not a
    # power of two, int64 offsets, and all three heads in one program (HEAD_GROUP).
    from gem_kernels.block.triton import launched_with

    lengths = torch.randint(0, 50, (37,)).tolist()
    lengths[5] = 0
    total = sum(lengths)
    offsets64 = _offsets(lengths).long()
    for d, dv, block_size, rotary in ((48, 24, 24, Rotary(base=100.0)), (20, 40, 16, None), (7, 9, 16, None)):
        q, k = torch.randn(total, 3, d), torch.randn(total, 3, d)
        v, grad = torch.randn(total, 3, dv), torch.randn(total, 3, dv)

        def fn(q, k, v, block_size=block_size, rotary=rotary):
            return block_attention(q, k, v, offsets64, max_seq_len=max(lengths), block_size=block_size,
                                   causal=True, rotary=rotary)  # fmt: skip

        name = f"block many-seqs d={d} dv={dv} bs={block_size} rotary={rotary is not None}"
        with launched_with(head_group=3):
            results.append(_compare(name, torch.float32, fn, [q, k, v], grad))


def rotary_cases(results):
    torch.manual_seed(1)
    lengths = [0, 1, 63, 64, 65, 3]
    total = sum(lengths)
    offsets = _offsets(lengths)
    x, grad = torch.randn(total, 3, 64), torch.randn(total, 3, 64)
    for pname, pos in (
        ("default", None),
        ("int", torch.randint(0, 3000, (total,))),
        ("float", torch.rand(total) * 50),
    ):
        for dtype in (torch.float32, torch.float16):

            def fn(x, pos=pos):
                return apply_rotary(x, offsets, positions=pos, base=10000.0)

            results.append(_compare(f"rotary positions={pname}", dtype, fn, [x], grad))


def jagged_cases(results):
    torch.manual_seed(2)
    lengths = [0, 1, 63, 64, 65, 3]
    total = sum(lengths)
    offsets = _offsets(lengths)
    for feat in ((3, 5), (130,)):
        x = torch.randn(total, *feat)
        for max_len in (70, 40):  # 40 truncates the longer sequences
            grad = torch.randn(len(lengths), max_len, *feat)
            for dtype in (torch.float32, torch.float16):

                def fn(x, max_len=max_len):
                    return jagged_to_padded(x, offsets, max_len, padding_value=-1.5)

                results.append(_compare(f"jagged_to_padded F={feat} max_len={max_len}", dtype, fn, [x], grad))
                padded = torch.randn(len(lengths), max_len, *feat)

                def fn2(p):
                    return padded_to_jagged(p, offsets, total)

                gj = torch.randn(total, *feat)
                results.append(_compare(f"padded_to_jagged F={feat} N={max_len}", dtype, fn2, [padded], gj))
        for dtype in (torch.float32, torch.float16):

            def fn3(x):
                return jagged_mean(x, offsets)

            gm = torch.randn(len(lengths), *feat)
            results.append(_compare(f"jagged_mean F={feat}", dtype, fn3, [x], gm))


def main() -> None:
    _count_launches()
    results: list[dict] = []
    block_cases(results)
    rotary_cases(results)
    jagged_cases(results)
    sys.stdout.write("JSON:" + json.dumps(results))


if __name__ == "__main__":
    main()
