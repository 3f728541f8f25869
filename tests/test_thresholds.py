import math

import pytest

from gradshare.message import BITMAP, SPARSE
from gradshare.thresholds import Adaptive, Fixed, ResidualClipping, TargetSparsity, as_threshold


def test_defaults_match_dl4j():
    a = Adaptive()
    assert (a.tau, a.min_sparsity, a.max_sparsity, a.decay) == (1e-3, 1e-4, 1e-2, 0.965936)
    t = TargetSparsity()
    assert (t.tau, t.target) == (1e-4, 1e-3)
    c = ResidualClipping()
    assert (c.c, c.every) == (5.0, 5)


def test_fixed_never_moves():
    f = Fixed(0.25)
    for count in (0, 10, 1000):
        f.observe(count, 1000, SPARSE)
    f.observe(0, 1000, BITMAP)
    assert f.tau == 0.25 and f.steps == 4


def test_adaptive_multiplicative_steps():
    a = Adaptive(initial=1e-3)
    a.observe(0, 10_000, SPARSE)                    # too sparse -> lower tau
    assert a.tau == pytest.approx(1e-3 * 0.965936)
    a.observe(50, 10_000, "sparse")                 # 5e-3 inside [1e-4, 1e-2] -> unchanged
    assert a.tau == pytest.approx(1e-3 * 0.965936)
    a.observe(500, 10_000, SPARSE)                  # too dense -> raise tau
    assert a.tau == pytest.approx(1e-3)


def test_adaptive_halves_in_twenty_steps():
    a = Adaptive(initial=1.0)
    for _ in range(20):
        a.observe(0, 100, SPARSE)
    assert a.tau == pytest.approx(0.5, rel=1e-4)


def test_bitmap_step_counts_as_one_sixteenth():
    a = Adaptive(initial=1e-3, min_sparsity=1e-4, max_sparsity=0.1)
    # A bitmap step with a true count of 1% is taken as 1/16 = 6.25%: inside [1e-4, 0.1], no move.
    a.observe(100, 10_000, BITMAP)
    assert a.last_density == 1 / 16 and a.tau == pytest.approx(1e-3)
    t = TargetSparsity(initial=1e-3, target=1e-3)
    t.observe(1, 10_000, BITMAP)                    # 1/16 > target although the count is tiny
    assert t.tau > 1e-3


def test_target_sparsity_steers_both_ways():
    t = TargetSparsity(initial=1e-4, target=1e-3)
    t.observe(0, 1000, SPARSE)
    assert t.tau < 1e-4
    lo = t.tau
    t.observe(100, 1000, SPARSE)
    assert t.tau == pytest.approx(1e-4) and t.tau > lo
    with pytest.raises(ValueError, match="1/16"):
        TargetSparsity(target=0.1)


def test_adaptive_converges_into_the_band():
    # Density falls as tau grows (here density = 1e-4 / tau); the band is reached and held.
    a = Adaptive(initial=1e-4)
    for _ in range(400):
        d = min(1.0, 1e-4 / a.tau)
        a.observe(int(d * 1_000_000), 1_000_000, SPARSE if d < 1 / 16 else BITMAP)
    d = 1e-4 / a.tau
    assert 1e-4 * 0.9 <= d <= 1e-2 / 0.9


def test_state_round_trip_and_kind_check():
    a = Adaptive(initial=2e-3, min_sparsity=1e-3, max_sparsity=5e-2, decay=0.9)
    for c in (0, 0, 900):
        a.observe(c, 10_000, SPARSE)
    b = Adaptive(initial=2e-3, min_sparsity=1e-3, max_sparsity=5e-2, decay=0.9)
    b.load_state_dict(a.state_dict())
    assert (b.tau, b.steps, b.last_density) == (a.tau, a.steps, a.last_density)
    a.observe(0, 10, SPARSE)
    b.observe(0, 10, SPARSE)
    assert a.tau == b.tau
    with pytest.raises(ValueError, match="Adaptive"):
        Fixed(1.0).load_state_dict(a.state_dict())


def test_clone_is_independent():
    a = Adaptive()
    c = a.clone()
    c.observe(0, 100, SPARSE)
    assert a.tau == 1e-3 and c.tau < 1e-3


def test_residual_clipping_schedule_and_state():
    c = ResidualClipping(c=3.0, every=4)
    assert [c.factor(s) for s in range(6)] == [3.0, None, None, None, 3.0, None]
    d = ResidualClipping()
    d.load_state_dict(c.state_dict())
    assert (d.c, d.every) == (3.0, 4)
    with pytest.raises(ValueError):
        ResidualClipping(every=0)


def test_argument_checks():
    with pytest.raises(ValueError):
        Fixed(0.0)
    with pytest.raises(ValueError):
        Adaptive(min_sparsity=0.1, max_sparsity=0.01)
    with pytest.raises(ValueError):
        Adaptive(decay=1.5)
    with pytest.raises(ValueError):
        Adaptive().observe(1, 10, "nonfinite")
    assert isinstance(as_threshold(0.5), Fixed) and isinstance(as_threshold(None), Adaptive)
    assert math.isfinite(Adaptive(initial=1e-30).observe(0, 10, SPARSE))


def test_density_warmup_schedule_values():
    a = Adaptive(initial=1.0, min_sparsity=1e-4, max_sparsity=1e-2, warmup_steps=4)
    f = (1 / 16) / 1e-2                                  # 6.25: the band starts with its top at 1/16
    assert a.band(0) == (1e-4 * f, 1e-2 * f) and a.band(0)[1] == 1 / 16
    assert a.band(2) == (1e-4 * 2.5, 1e-2 * 2.5)         # 6.25 ** 0.5 == 2.5 exactly
    assert a.band(1) == (1e-4 * f ** 0.75, 1e-2 * f ** 0.75)
    assert a.band(4) == a.band(100) == (1e-4, 1e-2)
    assert Adaptive(warmup_steps=0).band(0) == (1e-4, 1e-2)
    # density 0.03 at observation 0 is inside the warm band (tau stays), outside the plain one (tau rises)
    a.observe(300, 10_000, SPARSE)
    assert a.tau == 1.0
    plain = Adaptive(initial=1.0)
    plain.observe(300, 10_000, SPARSE)
    assert plain.tau == 1.0 / 0.965936
    # at observation 1 the band's low edge is 1e-4 * 6.25**0.75 = 3.95e-4: density 3e-4 lowers tau
    a.observe(3, 10_000, SPARSE)
    assert a.tau == 0.965936
    t = TargetSparsity(target=1e-3, warmup_steps=2, warmup_density=4e-3)
    assert (t.target_at(0), t.target_at(1), t.target_at(2)) == (1e-3 * 4.0, 1e-3 * 2.0, 1e-3)
    with pytest.raises(ValueError):
        Adaptive(warmup_steps=5, warmup_density=0.5)
    with pytest.raises(ValueError):
        Adaptive(warmup_steps=-1)
