"""Bucket feedback: the sizes a BucketedStep saw -> the buckets that pad least for their compile count."""

from __future__ import annotations

import itertools
import random

import pytest
from recir.embedding import bucketize, padding_waste, suggest_buckets
from recir.transforms import ConfigError


def _padding(hist: dict[int, int], buckets) -> int:
    return sum((bucketize(n, buckets) - n) * c for n, c in hist.items())


@pytest.mark.parametrize("seed", range(6))
def test_suggest_buckets_is_the_exact_optimum(seed):
    """Against brute force over every bucket set of the candidates (observed sizes, aligned)."""
    rng = random.Random(seed)
    hist = {rng.randint(1, 300): rng.randint(1, 20) for _ in range(rng.randint(3, 12))}
    for multiple_of, k in ((1, 1), (1, 3), (8, 2), (8, 4)):
        got = suggest_buckets({"f": hist}, max_buckets=k, multiple_of=multiple_of).buckets["f"]
        cands = sorted({max(-(-n // multiple_of) * multiple_of, multiple_of) for n in hist})
        best = min(
            _padding(hist, (*rest, cands[-1]))
            for r in range(min(k, len(cands)))
            for rest in itertools.combinations(cands[:-1], r)
        )
        assert len(got) <= k and all(b % multiple_of == 0 for b in got)
        assert _padding(hist, got) == best, (hist, multiple_of, k, got)


def test_compile_cost_trades_buckets_for_padding():
    sizes = {"f": [10] * 50 + [1000] * 50}  # two clusters: a second bucket saves 50 * 990 slots
    assert suggest_buckets(sizes, max_buckets=4, multiple_of=1).buckets["f"] == (10, 1000)
    assert suggest_buckets(sizes, max_buckets=4, compile_cost=49_000, multiple_of=1).buckets["f"] == (
        10,
        1000,
    )
    assert suggest_buckets(sizes, max_buckets=4, compile_cost=50_000, multiple_of=1).buckets["f"] == (1000,)


def test_skewed_lengths_pad_less_than_powers_of_two():
    rng = random.Random(0)
    sizes = {"item": [min(int(rng.lognormvariate(4.0, 0.6)), 2000) for _ in range(2000)]}
    s = suggest_buckets(sizes, max_buckets=4)
    assert s.waste_before == pytest.approx(padding_waste(sizes))  # powers of two from 8: the default
    assert s.waste_after == pytest.approx(padding_waste(sizes, s.buckets))
    # powers of two used 7 buckets: 4 chosen ones pad less, 7 pad less than half as much
    assert s.compiles_before == 7 and s.compiles_after == 4 and s.waste_after < s.waste_before
    assert suggest_buckets(sizes, max_buckets=7).waste_after < s.waste_before / 2
    assert "padding waste" in str(s) and "item [" in str(s)


def test_suggest_buckets_refuses_bad_input():
    with pytest.raises(ConfigError, match="no observed sizes for \\['f'\\].*Fix: run some batches first"):
        suggest_buckets({"f": []})
    with pytest.raises(ConfigError, match="max_buckets and multiple_of must be >= 1"):
        suggest_buckets({"f": [3]}, max_buckets=0)
    with pytest.raises(ConfigError, match="must be >= 0"):
        suggest_buckets({"f": [-1]})
