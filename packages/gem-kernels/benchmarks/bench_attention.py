"""Benchmark of jagged softmax attention and GDPA against padded SDPA, FlexAttention and padded PyTorch.

Every row of issue 3's table, bf16, H=4, D=128, on one GPU; all baselines timed in the same run. For each
case it first checks our kernels in bf16 against the fp32 reference on the first sequences of the batch
(forward and the three gradients), then times forward, backward and forward+backward.

Useful TFLOP/s count valid (query, key) pairs only: forward 4·P·H·D (QKᵀ and PV), backward 2.5x forward
(the FlashAttention convention: dV, dP, dQ, dK and the recomputation of QKᵀ). The HBM rows compare the
forward with the time to move Q, K, V and O once at the measured copy rate.

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':')
    python packages/gem-kernels/benchmarks/bench_attention.py [--cases cross,pma] [--json out.json]
    # several implementations on the same inputs in one run (rows "case@variant"; baselines once per case):
    python packages/gem-kernels/benchmarks/bench_attention.py --variants auto,tiled,onetile,onetile_split,tma
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
import triton.testing
from common import copy_rate

from gem_kernels import gdpa, jagged_flash_attention
from gem_kernels.attention import reference

H, D = 4, 128
DTYPE = torch.bfloat16
DEV = "cuda"


# ------------------------------------------------------------------------------------------ inputs


def lognormal_lengths(b: int, max_len: int, mean: float, seed: int) -> torch.Tensor:
    """Log-normal lengths (sigma 0.8) clamped to [1, max_len], mu chosen so the clamped mean is ~mean."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, generator=g, dtype=torch.float64)
    lo, hi = 0.0, math.log(max_len)
    for _ in range(60):
        mu = (lo + hi) / 2
        m = torch.exp(mu + 0.8 * z).round().clamp(1, max_len).mean().item()
        lo, hi = (mu, hi) if m < mean else (lo, mu)
    return torch.exp(mu + 0.8 * z).round().clamp(1, max_len).long()


def uniform_lengths(b: int, lo: int, hi: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (b,), generator=g)


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(DEV, torch.int32)


def rand(n: int, d: int = D) -> torch.Tensor:
    return torch.randn(n, H, d, device=DEV, dtype=DTYPE)


# ------------------------------------------------------------------------------------------ timing


def bench(fn) -> float:
    """Median milliseconds."""
    if DEV == "cpu":  # --smoke: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def peak_mem_gb(fn) -> float:
    if DEV == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def copy_rate_tbs() -> float:
    """HBM copy rate, bytes read + written per second, of a 2 GiB device-to-device copy."""
    ms, nbytes = copy_rate(DEV, 1 << (30 if DEV == "cuda" else 20), bench)
    return nbytes / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------ ours


class Ours:
    """Our op on one jagged problem: fwd, bwd (the backward op alone), fwd+bwd through autograd."""

    def __init__(self, act, q, k, v, qo, ko, max_q, max_k, causal=False, window=None):
        self.args = (act, qo, ko, max_q, max_k, causal, window)
        self.q, self.k, self.v = (t.detach().requires_grad_(True) for t in (q, k, v))
        self.dout = torch.randn(q.shape[0], H, v.shape[2], device=DEV, dtype=DTYPE)

    def call(self, q, k, v):
        act, qo, ko, max_q, max_k, causal, window = self.args
        if act == "softmax":
            return jagged_flash_attention(
                q, k, v, qo, ko, max_q_len=max_q, max_kv_len=max_k, causal=causal, window=window
            )
        return gdpa(
            q, k, v, qo, ko, max_q_len=max_q, max_kv_len=max_k, activation=act, causal=causal, window=window
        )

    def fwd(self):
        with torch.no_grad():
            return self.call(self.q, self.k, self.v)

    def fwd_bwd(self):
        self.q.grad = self.k.grad = self.v.grad = None
        self.call(self.q, self.k, self.v).backward(self.dout)

    def bwd_fn(self):
        """The backward custom op alone, on saved forward outputs."""
        act, qo, ko, max_q, max_k, causal, window = self.args
        kv = qo if ko is None else ko
        left, right = (-1, -1) if window is None else window
        if causal:
            right = 0
        scale = D**-0.5
        out_scale = 1.0 if act == "softmax" else 1.0 / max(max_k or max_q, 1)
        q, k, v = (t.detach() for t in (self.q, self.k, self.v))
        out, lse = torch.ops.gem_kernels.jagged_attention_fwd(
            q, k, v, qo, kv, max_q, max_k or max_q, act, left, right, scale, out_scale
        )
        bwd = torch.ops.gem_kernels.jagged_attention_bwd
        return lambda: bwd(
            self.dout, q, k, v, out, lse, qo, kv, max_q, max_k or max_q, act, left, right, scale, out_scale
        )

    def check(self, n_seq: int) -> dict:
        """Errors (relative Frobenius) of our bf16 output and grads vs the fp32 reference, on the first
        ``n_seq`` sequences, next to the errors of the reference run on bf16 inputs."""
        _, qo, ko, *_ = self.args
        kv = qo if ko is None else ko
        nq = int(qo[n_seq])
        nk = int(kv[n_seq])
        self.fwd_bwd()
        ours = (
            self.call(self.q, self.k, self.v).detach()[:nq],
            self.q.grad[:nq],
            self.k.grad[:nk],
            self.v.grad[:nk],
        )
        sub = (self.q.detach()[:nq], self.k.detach()[:nk], self.v.detach()[:nk])
        qo_s = qo[: n_seq + 1]
        ko_s = None if ko is None else ko[: n_seq + 1]

        def ref(dtype):
            from gem_kernels import use_backend

            ts = [t.detach().clone().to(dtype).requires_grad_(True) for t in sub]
            with use_backend("reference"):
                act_, _, _, mq, mk, c, w = self.args
                if act_ == "softmax":
                    o = jagged_flash_attention(
                        *ts, qo_s, ko_s, max_q_len=mq, max_kv_len=mk, causal=c, window=w
                    )
                else:
                    o = gdpa(
                        *ts,
                        qo_s,
                        ko_s,
                        max_q_len=mq,
                        max_kv_len=mk,
                        activation=act_,
                        causal=c,
                        window=w,
                        out_scale=1.0 / max(mk or mq, 1),
                    )
                o.backward(self.dout[:nq].to(dtype))
            return (o.detach(), ts[0].grad, ts[1].grad, ts[2].grad)

        r32, r16 = ref(torch.float32), ref(DTYPE)

        def rel(a, b):
            return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

        err = [rel(a, b) for a, b in zip(ours, r32)]
        ref_err = [rel(a, b) for a, b in zip(r16, r32)]
        ok = all(e <= 4 * r + 2e-3 for e, r in zip(err, ref_err)) and all(
            bool(torch.isfinite(t).all()) for t in ours
        )
        return {"err": err, "ref_err": ref_err, "ok": ok}


# ------------------------------------------------------------------------------------------ baselines


def pad(x: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[T, H, d] -> [B, H, max_len, d], zeros in the padding."""
    b = lengths.numel()
    out = x.new_zeros(b, max_len, x.shape[1], x.shape[2])
    idx = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(DEV)
    seq = torch.repeat_interleave(torch.arange(b), lengths).to(DEV)
    out[seq, idx] = x
    return out.transpose(1, 2).contiguous()


def padded_sdpa(q, k, v, lengths, max_len, causal):
    qp, kp, vp = (pad(t, lengths, max_len).requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(qp)

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)

    def fwd_bwd():
        qp.grad = kp.grad = vp.grad = None
        F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal).backward(dout)

    return fwd, fwd_bwd


def padded_silu(q, k, v, lengths, max_len, causal):
    """Plain PyTorch GDPA on the padded batch: masks padding (and the causal upper triangle)."""
    qp, kp, vp = (pad(t, lengths, max_len).requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(qp)
    pos = torch.arange(max_len, device=DEV)
    valid = pos[None, :] < lengths.to(DEV)[:, None]  # [B, L]
    mask = valid[:, None, :, None] & valid[:, None, None, :]
    if causal:
        mask = mask & (pos[None, None, None, :] <= pos[None, None, :, None])

    def f():
        s = (qp @ kp.transpose(-1, -2)) * D**-0.5
        return (F.silu(s) * mask) @ vp * (1.0 / max_len)

    def fwd():
        with torch.no_grad():
            return f()

    def fwd_bwd():
        qp.grad = kp.grad = vp.grad = None
        f().backward(dout)

    return fwd, fwd_bwd


_flex = None


def flex(q, k, v, q_lengths, kv_lengths, causal=False, window_left=None):
    """FlexAttention on the packed sequences [1, H, T, D] with a document (+ causal / window) block mask."""
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    q_doc = torch.repeat_interleave(torch.arange(q_lengths.numel()), q_lengths).to(DEV)
    kv_doc = torch.repeat_interleave(torch.arange(kv_lengths.numel()), kv_lengths).to(DEV)

    def mask_mod(b, h, qi, ki):
        m = q_doc[qi] == kv_doc[ki]
        if causal:
            m = m & (ki <= qi)
        if window_left is not None:
            m = m & (qi - ki <= window_left)
        return m

    bm = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=DEV, _compile=True)
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).detach().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(qf)

    def fwd():
        with torch.no_grad():
            return _flex(qf, kf, vf, block_mask=bm)

    def fwd_bwd():
        qf.grad = kf.grad = vf.grad = None
        _flex(qf, kf, vf, block_mask=bm).backward(dout)

    return fwd, fwd_bwd


# ------------------------------------------------------------------------------------------ cases


SMOKE = 1  # divides batch sizes and lengths (--smoke: a CPU run of the script's logic at tiny shapes)


def case_inputs(name):
    """(q_lengths, kv_lengths or None) of a case."""
    if SMOKE > 1:
        lq, lk = _case_inputs(name)
        lq = (lq[: max(2, lq.numel() // SMOKE)] // SMOKE).clamp_min(1)
        return lq, None if lk is None else lk[: lq.numel()]
    return _case_inputs(name)


def _case_inputs(name):
    if name.endswith("_b64"):
        return lognormal_lengths(64, 4096, 1404, seed=0), None
    if name.endswith("_b1024"):
        return uniform_lengths(1024, 1, 2000, seed=1), None
    if name == "cross":
        return uniform_lengths(1024, 1, 2000, seed=2), uniform_lengths(1024, 16, 64, seed=3)
    if name == "pma":
        return torch.full((1024,), 32), lognormal_lengths(1024, 4096, 1404, seed=4)
    raise ValueError(name)


CASES = {
    # name: (activation, causal, window, baselines)
    "self_causal_softmax_b64": ("softmax", True, None, ("sdpa", "flex")),
    "self_causal_silu_b64": ("silu", True, None, ("padded_silu",)),
    "self_silu_b64": ("silu", False, None, ("flex",)),
    "self_silu_b1024": ("silu", False, None, ("flex",)),
    "window_softmax_b1024": ("softmax", True, (256, 0), ("flex",)),
    "window_silu_b1024": ("silu", True, (256, 0), ()),
    "cross": ("silu", False, None, ("flex",)),
    "pma": ("silu", False, None, ("flex",)),
}


def setup_case(name: str) -> dict:
    """Inputs of a case: lengths, offsets, random q/k/v and the count of valid pairs."""
    act, causal, window, _ = CASES[name]
    lq, lk = case_inputs(name)
    cross = lk is not None
    lk_ = lk if cross else lq
    c = dict(name=name, act=act, causal=causal, window=window, lq=lq, lk=lk_, cross=cross)
    c["max_q"], c["max_k"] = int(lq.max()), int(lk_.max())
    c["qo"], c["ko"] = offsets_of(lq), (offsets_of(lk) if cross else None)
    c["q"], c["k"], c["v"] = rand(int(lq.sum())), rand(int(lk_.sum())), rand(int(lk_.sum()))
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    c["pairs"] = reference.count_valid_pairs(c["qo"], c["qo"] if c["ko"] is None else c["ko"], left, right)
    return c


def run_ours(c: dict, copy_tbs: float, check_seqs: int, variant: str = "auto") -> dict:
    from gem_kernels.attention import testing

    fwd_flop = 4 * c["pairs"] * H * D
    row = {
        "case": c["name"],
        "variant": variant,
        "act": c["act"],
        "B": c["lq"].numel(),
        "mean_q": c["lq"].float().mean().item(),
        "mean_kv": c["lk"].float().mean().item(),
        "pairs": c["pairs"],
    }
    ours = Ours(
        c["act"],
        c["q"],
        c["k"],
        c["v"],
        c["qo"],
        c["ko"],
        c["max_q"],
        c["max_k"] if c["cross"] else None,
        c["causal"],
        c["window"],
    )
    t0 = time.time()
    before = testing.auto_choices()
    ours.fwd_bwd()  # compile + autotune (+ the choice between tiled and one-tile kernels)
    sync()
    row["tune_s"] = time.time() - t0
    row["variants"] = {k[0]: v for k, v in testing.auto_choices().items() if k not in before}
    if DEV == "cuda":
        prefix = "persistent_" if variant == "tma" else ""
        tuners = testing.autotuners()
        row["configs"] = {
            n: str(getattr(tuners[prefix + n], "best_config", None)) for n in ("fwd", "dq", "dkdv")
        }
        row["paths"] = sorted({f"{k}:{p}" for k, p in testing.persistent_launches()})
    row["check"] = ours.check(check_seqs)
    row["ours_fwd_ms"] = bench(ours.fwd)
    row["ours_bwd_ms"] = bench(ours.bwd_fn())
    row["ours_fwdbwd_ms"] = bench(ours.fwd_bwd)
    row["ours_fwd_tflops"] = fwd_flop / row["ours_fwd_ms"] / 1e9
    row["ours_bwd_tflops"] = 2.5 * fwd_flop / row["ours_bwd_ms"] / 1e9
    row["ours_fwdbwd_tflops"] = 3.5 * fwd_flop / row["ours_fwdbwd_ms"] / 1e9
    row["ours_peak_gb"] = peak_mem_gb(ours.fwd_bwd)
    hbm_bytes = 2 * (2 * c["q"].numel() + c["k"].numel() + c["v"].numel())
    row["hbm_floor_ms"] = hbm_bytes / (copy_tbs * 1e12) * 1e3
    row["fwd_frac_of_copy"] = row["hbm_floor_ms"] / row["ours_fwd_ms"]
    return row


def run_baselines(c: dict, row: dict) -> None:
    q, k, v, lq = c["q"], c["k"], c["v"], c["lq"]
    for base in CASES[c["name"]][3]:
        try:
            if base == "sdpa":
                fwd, fb = padded_sdpa(q, k, v, lq, c["max_q"], c["causal"])
            elif base == "padded_silu":
                fwd, fb = padded_silu(q, k, v, lq, c["max_q"], c["causal"])
            else:
                window_left = None if c["window"] is None else c["window"][0]
                fwd, fb = flex(q, k, v, lq, c["lk"], causal=c["causal"], window_left=window_left)
            fb()
            row[f"{base}_fwd_ms"] = bench(fwd)
            row[f"{base}_fwdbwd_ms"] = bench(fb)
            row[f"{base}_bwd_ms"] = row[f"{base}_fwdbwd_ms"] - row[f"{base}_fwd_ms"]
            row[f"{base}_peak_gb"] = peak_mem_gb(fb)
            del fwd, fb
        except Exception as e:  # a failing baseline must not hide the others
            row[f"{base}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if DEV == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--baselines", default=",".join(CASES), help="cases whose baselines run (after ours)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--check-seqs", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, reference path")
    ap.add_argument(
        "--variant",
        default="auto",
        help="tiled | onetile | onetile_split | auto (time those that apply per bucket) | tma",
    )
    ap.add_argument(
        "--variants", default=None, help="comma-separated variants, each timed on the same inputs"
    )
    a = ap.parse_args()
    run(a)


def run(a) -> None:
    global DEV, SMOKE, DTYPE
    if a.smoke:
        DEV, SMOKE, DTYPE, a.check_seqs = "cpu", 64, torch.float32, 2
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    copy_tbs = copy_rate_tbs()
    print(f"HBM copy rate: {copy_tbs:.2f} TB/s")
    rows: dict[str, dict] = {}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"copy_tbs": copy_tbs, "rows": list(rows.values())}, f, indent=1)

    from gem_kernels.attention import testing

    variants = a.variants.split(",") if a.variants else [a.variant]
    key = (lambda n, v: n) if len(variants) == 1 else (lambda n, v: f"{n}@{v}")
    # Ours first for every case, then the baselines (slow to compile), so that a time limit cuts baselines.
    for name in a.cases.split(","):
        c = setup_case(name)  # the same inputs for every variant
        for v in variants:
            t0 = time.time()
            try:
                with testing.forced(variant=v):
                    rows[key(name, v)] = run_ours(c, copy_tbs, a.check_seqs, v)
            except Exception as e:  # one failing variant must not hide the others
                rows[key(name, v)] = {
                    "case": name,
                    "variant": v,
                    "error": f"{type(e).__name__}: {str(e)[:500]}",
                }
            rows[key(name, v)]["case_s"] = time.time() - t0
            print(json.dumps(rows[key(name, v)]), flush=True)
            save()
            if DEV == "cuda":
                torch.cuda.empty_cache()
        del c
    for name in a.baselines.split(","):
        ok = [key(name, v) for v in variants if key(name, v) in rows and "error" not in rows[key(name, v)]]
        if not ok:
            continue
        t0 = time.time()
        base_row: dict = {}
        run_baselines(setup_case(name), base_row)
        base_row["baseline_s"] = time.time() - t0
        for k in ok:  # the same baseline numbers beside every variant of the case
            rows[k].update(base_row)
            print(json.dumps(rows[k]), flush=True)
        save()
    print_table(list(rows.values()))


def print_table(rows: list[dict]) -> None:
    print("\ncase | fwd ms (TF/s) | bwd ms | fwd+bwd ms (TF/s) | baselines fwd / fwd+bwd ms | check")
    for r in rows:
        if "error" in r:
            print(f"{r['case']}@{r.get('variant')} | ERROR {r['error'][:200]}")
            continue
        ratio = ""
        if "flex_fwdbwd_ms" in r:
            ratio = f" | flex/ours fwd {r['flex_fwd_ms'] / r['ours_fwd_ms']:.2f}x fwd+bwd " + (
                f"{r['flex_fwdbwd_ms'] / r['ours_fwdbwd_ms']:.2f}x"
            )
        base = "; ".join(
            f"{b}: {r[b + '_fwd_ms']:.2f} / {r[b + '_fwdbwd_ms']:.2f}"
            for b in ("sdpa", "flex", "padded_silu")
            if b + "_fwd_ms" in r
        )
        errs = [k for k in r if k.endswith("_error")]
        print(
            f"{r['case']}@{r.get('variant')} | {r['ours_fwd_ms']:.3f} ({r['ours_fwd_tflops']:.0f}) | "
            f"{r['ours_bwd_ms']:.3f} | "
            f"{r['ours_fwdbwd_ms']:.3f} ({r['ours_fwdbwd_tflops']:.0f}) | {base} {errs} | "
            f"{'ok' if r['check']['ok'] else 'FAIL'} {max(r['check']['err']):.1e} | "
            f"copy-frac {r['fwd_frac_of_copy']:.2f}{ratio}"
        )


if __name__ == "__main__":
    main()
