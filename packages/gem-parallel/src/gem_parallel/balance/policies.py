"""Batch-building policies of Base Batch Shuffling, batched over ranks (one row per rank).

The shuffler runs them with one row (its own rank); the simulator runs thousands of rows at once. All are
pure functions of their inputs (and a ``torch.Generator`` where random), so a rank's stream is reproducible.

Pool policies split a pool of ``P = m * b`` samples into ``m`` batches of ``b`` samples, each aiming at the
pool's mean (which itself differs between ranks by the pool's sampling noise):

- ``"random"``: no balancing (the baseline).
- ``"pair"``: sort by cost, pair the heaviest remaining with the lightest, deal pairs round-robin.
- ``"lpt"``: longest processing time first: heaviest first, each to the lightest batch not yet full.
- ``"snake"``: serpentine over the sorted pool (0, 1, .., m-1, m-1, .., 0, ...).

The one-batch-at-a-time policies build each batch from a pool that is refilled after every batch, with
:func:`sliding_select` picking ``b`` samples whose cost sum is close to a target. They differ in the target
(``level``: the expected cost of a sample, the same on every rank; ``excess``: the pool's cost above ``level``
times its size):

- ``"sliding"``: ``b * level + feedback * excess``. The batch's deviation is proportional to the pool's, so
  its spread over ranks is about ``sqrt(feedback / 2)`` of random batches', in both directions.
- ``"capped"`` (:func:`capped_target`): the same, but never above ``(1 + headroom) * b * level``. When the
  stream brings more than that, the rest waits in the pool (a queue that drains by up to ``headroom * b *
  level`` per batch), so the heaviest of many ranks is bounded by the cap instead of by the tail of a spread
  (which, with small batches and heavy-tailed lengths, the pool cannot absorb at a small ``feedback``).
  Samples waiting ``soft_wait`` batches or more are taken first, oldest first, while they fit under the
  target (:func:`take_overdue`), which bounds every sample's wait without pushing a batch over its cap.
"""

from __future__ import annotations

import torch

__all__ = ["POOL_POLICIES", "capped_target", "plan_pool", "sliding_select", "take_overdue"]

POOL_POLICIES = ("random", "pair", "lpt", "snake")
_TILT = 5.0  # exp(5) ~ 150: the tilt's ends are close to "the b lightest" and "the b heaviest"


def plan_pool(
    costs: torch.Tensor, m: int, policy: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Splits each row's pool into ``m`` equal batches.

    Args:
        costs: ``[R, P]`` float64 sample costs, one row per rank; ``P`` a multiple of ``m`` (of ``2 m`` for
            ``"pair"``).
        m: batches per pool.
        policy: one of :data:`POOL_POLICIES`.
        generator: randomness of ``"random"`` (and nothing else).

    Returns:
        ``[R, P]`` int64 batch index in ``[0, m)`` of each sample; every batch holds ``P / m`` samples.
    """
    if costs.dim() != 2:
        raise ValueError(f"plan_pool: costs must be [R, P], got {list(costs.shape)}")
    r, p = costs.shape
    unit = 2 * m if policy == "pair" else m
    if m < 1 or p % unit:
        raise ValueError(f"plan_pool: pool size {p} must be a multiple of {unit} for policy {policy!r}")
    out = torch.empty((r, p), dtype=torch.int64)
    if policy == "random":
        order = torch.argsort(torch.rand((r, p), generator=generator, dtype=torch.float64), dim=1)
        return out.scatter_(1, order, (torch.arange(p) % m).expand(r, p).contiguous())
    order = torch.sort(costs, dim=1, descending=True, stable=True).indices  # heaviest first
    if policy == "pair":
        i = torch.arange(p // 2)
        # Position i (heavy) and p-1-i (light) form pair i, which goes to batch i mod m.
        labels = torch.cat([i % m, (i % m).flip(0)])
    elif policy == "snake":
        i = torch.arange(p)
        rnd, j = i // m, i % m
        labels = torch.where(rnd % 2 == 0, j, m - 1 - j)
    elif policy == "lpt":
        return out.scatter_(1, order, _lpt(torch.gather(costs, 1, order), m))
    else:
        raise ValueError(f"unknown pool policy {policy!r}; choose from {POOL_POLICIES}")
    return out.scatter_(1, order, labels.expand(r, p).contiguous())


def _lpt(sorted_desc: torch.Tensor, m: int) -> torch.Tensor:
    """Batch of each position of ``[R, P]`` costs sorted heaviest first (LPT under a size cap)."""
    r, p = sorted_desc.shape
    cap = p // m
    load = torch.zeros((r, m), dtype=torch.float64)
    count = torch.zeros((r, m), dtype=torch.int64)
    labels = torch.empty((r, p), dtype=torch.int64)
    rows = torch.arange(r)
    for i in range(p):
        j = torch.where(count < cap, load, float("inf")).argmin(1)
        labels[:, i] = j
        load[rows, j] += sorted_desc[:, i]
        count[rows, j] += 1
    return labels


def sliding_select(
    costs: torch.Tensor,
    valid: torch.Tensor,
    forced: torch.Tensor,
    b: int,
    target: torch.Tensor,
    *,
    swaps: int = 4,
    probes: int = 64,
    bisect_steps: int = 16,
) -> torch.Tensor:
    """Picks ``b`` samples per row whose cost sum is close to ``target``.

    Samples flagged ``forced`` (waited too long) are always taken. The rest are picked one per stride bin
    over the row's samples sorted by cost: a quantile-matched miniature of the pool. The stride's quantiles
    are then warped by one number per row (the tilt: towards the heavy or the light end), found by
    bisection so that the sum comes closest to the target; last, up to ``swaps`` times, the one exchange of
    a picked sample for an unpicked one that brings the sum closest to the target is made (``probes``
    picked samples, spread over the sorted order, each against its nearest unpicked match by binary search).

    Args:
        costs: ``[R, P]`` float64 sample costs (any value where not ``valid``).
        valid: ``[R, P]`` bool, slots holding a sample.
        forced: ``[R, P]`` bool, samples that must be picked (a subset of ``valid``).
        b: samples to pick per row; every row must hold at least ``b`` valid samples.
        target: ``[R]`` float64 wanted cost sum of each row's pick.

    Returns:
        ``[R, P]`` bool mask of the picked samples: exactly ``b`` per row.
    """
    r, p = costs.shape
    nvalid = valid.sum(1)
    if int(nvalid.min()) < b:
        raise ValueError(f"sliding_select: a row holds {int(nvalid.min())} samples, fewer than b = {b}")
    forced = forced & valid
    nf = forced.sum(1)
    if int(nf.max()) > b:  # more overdue samples than fit: the costliest wait one more batch
        key = torch.where(forced, costs, float("inf"))
        rank_in = torch.argsort(torch.argsort(key, dim=1, stable=True), dim=1)
        forced = forced & (rank_in < b)
        nf = forced.sum(1)
    cand = valid & ~forced
    # Candidates sorted by cost; the others (+inf) at the end.
    key = torch.where(cand, costs, float("inf"))
    sv, order = torch.sort(key, dim=1, stable=True)  # [R, P]
    sv = sv.contiguous()
    nc = cand.sum(1)  # [R]
    q = b - nf  # picks left per row
    fsum = torch.where(forced, costs, 0.0).sum(1)
    i = torch.arange(b, dtype=torch.float64)[None, :]
    use = i < q[:, None].double()
    u = (i + 0.5) / q.clamp(min=1)[:, None].double()  # stride quantiles of the candidates
    ncd = nc[:, None].double()
    last_ok = (nc - q)[:, None] + i.long()  # the highest position pick i can take and leave room after it

    def positions(tilt: torch.Tensor) -> torch.Tensor:
        # Quantiles warped by u -> u**exp(-TILT * tilt): tilt 0 is the plain stride (a miniature of the pool),
        # tilt -> 1 moves every pick towards the heaviest samples, -> -1 towards the lightest. Positions are
        # then made strictly increasing (distinct), which keeps the pick's sum monotone in tilt.
        raw = (u.pow(torch.exp(-_TILT * tilt)[:, None]) * ncd).floor().long()
        shifted = torch.cummax(torch.where(use, raw - i.long(), -(2**62)), dim=1).values + i.long()
        return torch.minimum(shifted.clamp(min=0), last_ok)

    def pick_sum(tilt: torch.Tensor) -> torch.Tensor:
        vals = torch.gather(sv, 1, torch.where(use, positions(tilt), 0).clamp(0, p - 1))
        return fsum + torch.where(use, vals, 0.0).sum(1)

    # Bisection on the tilt, all rows at once, for the pick whose sum is nearest the target.
    lo = torch.full((r,), -1.0, dtype=torch.float64)
    hi = torch.full((r,), 1.0, dtype=torch.float64)
    for _ in range(bisect_steps):
        mid = (lo + hi) / 2
        low = pick_sum(mid) < target
        lo, hi = torch.where(low, mid, lo), torch.where(low, hi, mid)
    s_lo, s_hi = pick_sum(lo), pick_sum(hi)
    pos = positions(torch.where((s_lo - target).abs() <= (s_hi - target).abs(), lo, hi))
    # In sorted space; unused picks land in an extra column that is dropped (stride positions are distinct
    # while q <= nc, so no two picks share a slot).
    picked = torch.zeros((r, p + 1), dtype=torch.bool)
    picked.scatter_(1, torch.where(use, pos, p), use)
    picked = picked[:, :p].contiguous()
    total = fsum + torch.where(picked, sv, 0.0).sum(1)
    arange_p = torch.arange(p)
    # Probes: `probes` of the picks, spread over the sorted order (a stride over the stride), tracked by
    # their index into `pos` so that a swapped-out probe is replaced by the sample swapped in.
    nq = torch.minimum(q, torch.tensor(probes))
    j = torch.arange(probes)[None, :]
    probe_idx = ((j + 0.5) * q[:, None].double() / nq.clamp(min=1)[:, None].double()).floor().long()
    probe_idx = probe_idx.clamp(max=max(b - 1, 0))
    probe_ok = j < nq[:, None]
    probe_pos = torch.gather(pos, 1, probe_idx).clamp(max=p - 1)  # [R, probes] sorted positions
    rows_all = torch.arange(r)
    for _ in range(swaps):
        resid = target - total  # want to add resid: swap out s, swap in u with u - s ~ resid
        free = (~picked) & (arange_p[None, :] < nc[:, None])
        # Nearest free slot at or before / at or after each sorted position.
        prev_free = torch.cummax(torch.where(free, arange_p, -1), dim=1).values
        next_free = torch.where(free, arange_p, p).flip(1).cummin(dim=1).values.flip(1)
        s_val = torch.gather(sv, 1, probe_pos)
        want = torch.nan_to_num(s_val + resid[:, None], posinf=1e300, neginf=-1e300).contiguous()
        at = torch.searchsorted(sv, want)
        best_err = resid.abs()
        best_k = torch.full((r,), -1, dtype=torch.int64)
        best_u = torch.zeros((r,), dtype=torch.int64)
        for guess in (torch.gather(prev_free, 1, (at - 1).clamp(0, p - 1)),
                      torch.gather(next_free, 1, at.clamp(0, p - 1))):  # fmt: skip
            ok = probe_ok & (guess >= 0) & (guess < p)
            u_val = torch.gather(sv, 1, guess.clamp(0, p - 1))
            err = torch.where(ok, (resid[:, None] - (u_val - s_val)).abs(), float("inf"))
            e, k = err.min(1)
            better = e < best_err
            best_err = torch.where(better, e, best_err)
            best_k = torch.where(better, k, best_k)
            best_u = torch.where(better, torch.gather(guess, 1, k[:, None])[:, 0], best_u)
        rows = torch.nonzero(best_k >= 0).flatten()
        if rows.numel() == 0:
            break
        ks, us = best_k.index_select(0, rows), best_u.index_select(0, rows)
        ss = probe_pos[rows, ks]
        picked[rows, ss] = False
        picked[rows, us] = True
        total.index_add_(0, rows, sv[rows, us] - sv[rows, ss])
        probe_pos[rows, ks] = us
    del rows_all
    out = torch.zeros((r, p), dtype=torch.bool)
    out.scatter_(1, order, picked)
    return out | forced


def capped_target(
    level: torch.Tensor, excess: torch.Tensor, b: int, headroom: float, feedback: float
) -> torch.Tensor:
    """Target cost sum of the ``"capped"`` policy: the ``"sliding"`` target, never above the cap.

    Args:
        level: ``[R]`` float64 expected cost of a sample (known, or the rank's running mean).
        excess: ``[R]`` float64 the pool's cost minus ``level`` times its number of samples.
        b: samples per batch.
        headroom: the cap is ``(1 + headroom) * b * level``.
        feedback: share of the pool's excess (or deficit) passed on to one batch.

    Returns:
        ``[R]`` float64 ``b * level + min(feedback * excess, headroom * b * level)``.
    """
    base = b * level
    return base + torch.minimum(feedback * excess, headroom * base)


def take_overdue(
    costs: torch.Tensor,
    valid: torch.Tensor,
    forced: torch.Tensor,
    age: torch.Tensor,
    b: int,
    target: torch.Tensor,
    soft_wait: int,
) -> torch.Tensor:
    """``forced`` plus the samples that have waited ``soft_wait`` batches or more, oldest first (lighter first
    within an age), for as long as each one still fits: the forced samples, the overdue ones taken so far and
    the lightest possible completion of the batch from the other samples stay at or below ``target``.

    Args:
        costs, valid, forced: ``[R, P]`` as for :func:`sliding_select`.
        age: ``[R, P]`` int64 batches each sample has waited.
        b: samples per batch.
        target: ``[R]`` float64 wanted cost sum.
        soft_wait: age from which a sample is taken first.

    Returns:
        ``[R, P]`` bool: the samples :func:`sliding_select` must take (at most ``b`` more than ``forced`` per
        row only if ``forced`` already held more).
    """
    forced = forced & valid
    due = valid & ~forced & (age >= soft_wait)
    if not bool(due.any()):
        return forced
    r, p = costs.shape
    inf = float("inf")
    # Due samples oldest first (two stable sorts: by cost, then by age descending); the others after them.
    by_cost = torch.sort(torch.where(due, costs, inf), dim=1, stable=True).indices
    age_by_cost = torch.gather(torch.where(due, age, -1), 1, by_cost)
    order = torch.gather(by_cost, 1, torch.sort(age_by_cost, dim=1, descending=True, stable=True).indices)
    is_due = torch.gather(due, 1, order)
    cum = torch.cumsum(torch.gather(torch.where(due, costs, 0.0), 1, order), dim=1)  # [R, P]
    # The lightest completion: prefix sums of the sorted costs of the samples neither forced nor due.
    other = valid & ~forced & ~due
    light = torch.sort(torch.where(other, costs, inf), dim=1).values
    light = torch.where(torch.isfinite(light), light, 0.0)
    prefix = torch.cat([torch.zeros((r, 1), dtype=costs.dtype), torch.cumsum(light, dim=1)], dim=1)
    left = (b - forced.sum(1))[:, None] - torch.arange(1, p + 1)[None, :]  # picks left after k due ones
    fits = (left >= 0) & (left <= other.sum(1)[:, None])
    total = torch.where(forced, costs, 0.0).sum(1)[:, None] + cum
    total = total + torch.gather(prefix, 1, left.clamp(0, p))
    ok = is_due & fits & (total <= target[:, None])
    take = torch.cumprod(ok.to(torch.int64), dim=1).bool()  # the leading run: stop at the first misfit
    return forced | torch.zeros_like(valid).scatter_(1, order, take)
