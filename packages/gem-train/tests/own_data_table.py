"""A user's own impressions table, written with pyarrow as a user would (not with gem's generator).

``write_ads_table`` writes rows of: a user id, an ad id, a dense ``price`` (unit scale, or in dollars with
``dollars=True``), a history (items, actions, timestamps), a request time ``ts`` and a ``click`` label drawn
from a hidden logistic model (``signal`` scales its logit: 0 gives labels independent of every feature).
``ads_config`` is the matching ``[data.parquet]`` config as a dict (for ``config_from_dict``) or TOML text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

N_USERS, N_ADS = 40, 30


def write_ads_table(
    path: Path,
    n: int,
    *,
    seed: int = 0,
    signal: float = 1.0,
    dollars: bool = False,
    start: int = 0,
    shuffle_time: bool = False,
    row_group: int = 64,
) -> np.ndarray:
    """Write ``n`` rows to ``path``; returns their request times (row ``i``'s ``ts``). Rows are in time order
    from row number ``start`` on, or in a random order with ``shuffle_time``."""
    world = np.random.default_rng(12345)  # the same hidden world for every table
    user_pref = world.normal(0.0, 1.5, N_USERS)
    ad_quality = world.normal(0.0, 1.5, N_ADS)
    rng = np.random.default_rng([seed, start])
    user = rng.integers(0, N_USERS, n)
    ad = rng.integers(0, N_ADS, n)
    ts = 1_700_000_000 + 60 * (start + np.arange(n, dtype=np.int64))
    if shuffle_time:
        ts = rng.permutation(ts)
    lengths = rng.integers(0, 6, n)
    items = [rng.integers(0, N_ADS, k).tolist() for k in lengths]
    hist_ts = [sorted((t - rng.integers(1, 3600, k)).tolist()) for t, k in zip(ts, lengths, strict=True)]
    price = rng.normal(0.0, 1.0, n)
    logit = -0.5 + signal * (user_pref[user] + ad_quality[ad] - 0.5 * price)
    click = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int8)
    table = pa.table(
        {
            "user_id": pa.array(user, pa.int64()),
            "ad_id": pa.array(ad, pa.int64()),
            "price": pa.array(price * 30.0 + 60.0 if dollars else price, pa.float64()),
            "hist_item": pa.array(items, pa.list_(pa.int64())),
            "hist_action": pa.array([[1] * k for k in lengths], pa.list_(pa.int64())),
            "hist_ts": pa.array(hist_ts, pa.list_(pa.int64())),
            "ts": pa.array(ts, pa.int64()),
            "click": pa.array(click, pa.int8()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group)
    return ts


def ads_section(root: Path, **over: Any) -> dict[str, Any]:
    """The ``[data.parquet]`` section of :func:`write_ads_table` files under ``root`` (train/*, test/*)."""
    sec: dict[str, Any] = {
        "root": str(root),
        "train": ["train/*.parquet"],
        "test": ["test/*.parquet"],
        "request_time": "ts",
        "dense": {"columns": ["price"]},
        "sparse": {"user_id": {"num_embeddings": N_USERS}, "ad_id": {"num_embeddings": N_ADS}},
        "sequences": {
            "history": {
                "items": "hist_item",
                "actions": "hist_action",
                "timestamps": "hist_ts",
                "num_items": N_ADS,
                "num_actions": 2,
                "max_len": 8,
            }
        },
        "labels": {"ctr": "click"},
    }
    sec.update(over)
    return sec


def ads_toml(root: Path, name: str = "my-ads", extra: str = "") -> str:
    """A complete run config for the table under ``root``, as a user would write it (TOML)."""
    return f"""[run]
name = "{name}"
device = "cpu"

[model]
name = "tiny"

[data]
source = "parquet"
batch_size = 64
eval_batch_size = 256

[data.parquet]
root = "{root}"
train = ["train/*.parquet"]
test = ["test/*.parquet"]
request_time = "ts"

[data.parquet.dense]
columns = ["price"]

[data.parquet.sparse.user_id]
num_embeddings = {N_USERS}

[data.parquet.sparse.ad_id]
num_embeddings = {N_ADS}

[data.parquet.sequences.history]
items = "hist_item"
actions = "hist_action"
timestamps = "hist_ts"
num_items = {N_ADS}
num_actions = 2
max_len = 8

[data.parquet.labels]
ctr = "click"
{extra}"""
