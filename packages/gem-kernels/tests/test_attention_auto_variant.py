"""Which kernels ``GEM_KERNELS_ATTENTION_VARIANT=auto`` runs (CPU): the persistent TMA kernels only where the
H200 measured them faster (sm_90, 16-bit inputs, the general shape class; the backward only without a
mask), the tiled or one-tile kernels everywhere else, and never on the CPU or under the interpreter; and the
test seam that forces them (:mod:`gem_kernels.attention.testing`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gem_kernels.attention import testing, variants

H100 = (9, 0)
BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "direction,kind,band,dtype,cap,tma_ok,expected",
    [
        ("fwd", "general", 0, BF16, H100, True, "tma"),
        ("fwd", "general", 1, BF16, H100, True, "tma"),  # causal forward: TMA won (0.612 vs 0.678 ms)
        ("fwd", "general", 2, torch.float16, H100, True, "tma"),
        ("bwd", "general", 0, BF16, H100, True, "tma"),  # unmasked backward: TMA won (2.71 vs 3.53 ms)
        ("bwd", "general", 1, BF16, H100, True, None),  # causal backward: the tiled kernels won
        ("bwd", "general", 2, BF16, H100, True, None),
        ("fwd", "general", 0, torch.float32, H100, True, None),  # fp32 tiles never timed
        ("fwd", "short_kv", 0, BF16, H100, True, None),  # one-tile kernels' class
        ("bwd", "few_q", 0, BF16, H100, True, None),
        ("fwd", "general", 0, BF16, H100, False, None),  # layout TMA cannot address
        ("fwd", "general", 0, BF16, (8, 0), True, None),  # no TMA before Hopper
        ("fwd", "general", 0, BF16, (10, 0), True, None),  # not measured on Blackwell
        ("fwd", "general", 0, BF16, None, True, None),
    ],
)
def test_auto_persistent_variant_rule(direction, kind, band, dtype, cap, tma_ok, expected):
    assert variants.auto_persistent_variant(direction, kind, band, dtype, cap, tma_ok) == expected


def test_auto_resolves_to_itself_on_the_cpu_and_forced_variants_win():
    q = torch.zeros(8, 2, 16, dtype=BF16)
    buckets = (1, 8, 8, 0)
    assert variants.resolve_variant("fwd", q, buckets, q, q, q) == variants.DEFAULT_VARIANT
    with testing.forced(variant="tma"):
        assert variants.resolve_variant("fwd", q, buckets, q, q, q) == "tma"
        with testing.forced(variant="tiled"):
            assert variants.resolve_variant("bwd", q, buckets, q, q, q) == "tiled"
        assert variants.resolve_variant("bwd", q, buckets, q, q, q) == "tma"
    assert variants.resolve_variant("fwd", q, buckets, q, q, q) == variants.DEFAULT_VARIANT


def test_forced_overrides_only_what_it_is_given_and_restores_on_error():
    base = variants.overrides()
    with testing.forced(variant="onetile", blocks=(16, 32)):
        with testing.forced(chunk=48):
            assert variants.overrides() == variants.Overrides("onetile", (16, 32), 48, False)
            assert variants.split_chunk("few_q") == 48
            assert variants.fixed_blocks() == (16, 32)
        assert variants.overrides().chunk is None
        assert variants.split_chunk("few_q") == variants.SPLIT_CHUNK["few_q"]
    with pytest.raises(RuntimeError), testing.forced(variant="tiled"):
        raise RuntimeError
    assert variants.overrides() == base
    for bad in (dict(variant="nope"), dict(blocks=(0, 32)), dict(blocks=(32,)), dict(chunk=0)):
        with pytest.raises(ValueError), testing.forced(**bad):
            pass
    assert variants.overrides() == base


def test_fixed_blocks_under_the_interpreter_unless_it_tunes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert variants.fixed_blocks() == variants.INTERPRETER_BLOCKS
    with testing.forced(tune_in_interpreter=True):
        assert variants.fixed_blocks() is None  # the tiled and one-tile kernels tune as on CUDA
        assert variants.fixed_blocks(tunable_in_interpreter=False) == variants.INTERPRETER_BLOCKS
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert variants.fixed_blocks() is None


def test_removed_variants_are_gone():
    for removed in ("persistent", "tma_ws", "single_pass"):
        assert removed not in variants.VARIANTS
        with pytest.raises(ValueError), testing.forced(variant=removed):
            pass


def test_tma_loads_where_the_layout_allows(monkeypatch):
    """``tma`` loads through descriptors where :func:`tma_supported` holds, else through pointers."""
    from gem_kernels.attention.triton import persistent_launch

    x = torch.zeros(4, 2, 16)
    monkeypatch.setattr(variants, "tma_supported", lambda *t: True)
    assert persistent_launch.kernel_consts({}, x) == {"USE_TMA": True}
    monkeypatch.setattr(variants, "tma_supported", lambda *t: False)
    assert persistent_launch.kernel_consts({}, x) == {"USE_TMA": False}


def test_tma_supported_reads_the_layout_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(4, 2, 16)
    assert variants.tma_supported(x, x)
    assert not variants.tma_supported(torch.zeros(4, 2, 24))  # head dim not a power of two
    assert not variants.tma_supported(torch.zeros(4, 2, 32)[..., :16])  # heads not packed in rows
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not variants.tma_supported(x)  # a CPU tensor off the interpreter


def test_every_autotuner_goes_through_the_tuning_cache_and_tries_the_first_candidates(monkeypatch):
    """Every attention kernel's autotuner is built by :func:`gem_kernels.tune_cache.autotune` (the one
    tuning cache); the persistent ones time at most ``tune_candidates()`` configs, the H200's pick first,
    and zero their work counter before each run."""
    from triton.runtime.autotuner import Autotuner

    from gem_kernels import tune_cache

    tuners = testing.autotuners()
    assert len(tuners) == 11
    for name, tuned in tuners.items():
        assert isinstance(tuned, Autotuner) and isinstance(tuned.persistent, tune_cache.PersistentTuning)
        assert tuned.persistent.name == name
    monkeypatch.setattr(tune_cache, "TUNE_CANDIDATES", 2)
    for name in ("persistent_fwd", "persistent_dq", "persistent_dkdv"):
        tuned = tuners[name]
        assert tuned.persistent.prune(["a", "b", "c"], {}) == ["a", "b"]
        assert tuned.reset_to_zero == ["counter"]
    monkeypatch.setattr(tune_cache, "TUNE_CANDIDATES", 1)
    assert tuners["persistent_fwd"].persistent.prune(["a", "b", "c"], {}) == ["a"]
    assert variants.PERSISTENT_CANDIDATES["fwd"][0] == (64, 8, 3)
    assert variants.PERSISTENT_CANDIDATES["dkdv"][0] == (64, 8, 3)


def _fake_kernel_a():  # stand-ins for kernels: the cache hashes this file for them
    pass


def _fake_kernel_b():
    pass


def _recorders(calls, costs):
    """Launchers ``tiled``, ``onetile``, ``split`` that record their name and sleep ``costs[name]`` s."""
    import time

    def make(name):
        def launch():
            calls.append(name)
            time.sleep(costs.get(name, 0.0))

        return launch

    return make("tiled"), make("onetile"), make("onetile_split")


def test_onetile_split_is_forced_like_the_others():
    """``onetile_split`` runs the split launcher where one exists (the backward), else the one-tile one (the
    forward); ``onetile`` and ``tiled`` are unchanged; the name is a known variant."""
    assert "onetile_split" in variants.VARIANTS
    calls = []
    tiled, onetile, split = _recorders(calls, {})
    key = ("test-forced",)
    for variant, with_split, expected in [
        ("onetile_split", True, "onetile_split"),
        ("onetile_split", False, "onetile"),
        ("onetile", True, "onetile"),
        ("tiled", True, "tiled"),
    ]:
        calls.clear()
        variants.AutoChoice().run(
            variant, key, [_fake_kernel_a], torch.device("cpu"), tiled, onetile, split if with_split else None
        )
        assert calls == [expected], (variant, with_split)


@pytest.fixture
def interpreted_auto(monkeypatch, tmp_path):
    """``auto`` times and uses the disk cache (in ``tmp_path``) as on CUDA, by wall clock."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("GEM_KERNELS_CACHE", str(tmp_path))
    with testing.forced(variant="auto", tune_in_interpreter=True):
        yield tmp_path


def test_auto_times_the_split_backward_too_and_reads_its_choice_back(interpreted_auto):
    calls = []
    costs = {"tiled": 0.03, "onetile": 0.02, "onetile_split": 0.0}
    key = ("bwd-test", 1024, 2048, 64, 0)
    kernels = [_fake_kernel_a, _fake_kernel_b]
    auto = variants.AutoChoice()
    auto.run("auto", key, kernels, torch.device("cpu"), *_recorders(calls, costs))
    # Each candidate: one launch to compile and tune, one timed; then the winner runs.
    assert calls == ["tiled"] * 2 + ["onetile"] * 2 + ["onetile_split"] * 3
    assert auto.chosen[key] == "onetile_split"
    auto.run("auto", key, kernels, torch.device("cpu"), *_recorders(calls, costs))
    assert calls[7:] == ["onetile_split"]  # this process remembers it
    # A new process (empty in-memory choices) reads the choice from disk and times nothing.
    calls.clear()
    variants.AutoChoice().run("auto", key, kernels, torch.device("cpu"), *_recorders(calls, costs))
    assert calls == ["onetile_split"]


def test_two_candidate_cache_entries_still_read_and_never_break_three(interpreted_auto):
    """An entry stored when a bucket had two candidates (every entry before ``onetile_split``, and the
    forward's still) is read by a two-candidate choice and ignored, not misread, by a three-candidate one."""
    from gem_kernels import tune_cache

    key = ("bwd-test-old", 1024, 2048, 64, 0)
    kernels = [_fake_kernel_a]
    old = {"tiled": lambda: 2.0, "onetile": lambda: 1.0}
    assert tune_cache.choose(key, kernels, old) == ("onetile", False)
    calls = []
    tiled, onetile, split = _recorders(calls, {"tiled": 0.02, "onetile": 0.01})
    # the forward: no split candidate
    variants.AutoChoice().run("auto", key, kernels, torch.device("cpu"), tiled, onetile)
    assert calls == ["onetile"]  # the old entry, read: nothing timed
    calls.clear()
    variants.AutoChoice().run("auto", key, kernels, torch.device("cpu"), tiled, onetile, split)
    assert calls == ["tiled"] * 2 + ["onetile"] * 2 + ["onetile_split"] * 3
    assert len(list((interpreted_auto / "v1").iterdir())) == 2  # the old entry kept beside the new one
    assert tune_cache.choose(key, kernels, old) == ("onetile", True)


def test_split_schedule_counts_chunks_on_the_device_and_bounds_the_grid():
    lengths = [0, 1, 1024, 1025, 3000, 2048]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    from gem_kernels.attention.triton.split import split_schedule

    starts, grid = split_schedule(offsets, sum(lengths), max(lengths), 1024, 4)
    # One chunk even for an empty sequence; ceil(len / 1024) otherwise.
    assert starts.tolist() == [0, 1, 2, 3, 5, 8, 10]
    assert grid == (min(6 + sum(lengths) // 1024, 6 * 3), 4)
    assert grid[0] >= starts[-1].item()
