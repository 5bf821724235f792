"""The profile's decode cost per batch size re-measured from served steps (served_shape.py)."""

from __future__ import annotations

import pytest

from pdserve.engine.step_log import StepRecord
from pdserve.latency.profiled import ProfiledLatency
from pdserve.validate.served_shape import served_bases, served_profile

# bases 60/64/91/91 ms per batch of 1/2/3/4 and 10 us per context token (a profile with a bad 3-row point)
PROFILE = ProfiledLatency((0.1, 0.005, 0.0), (0.06, 0.01, 1e-5),
                          decode_batch_base=((1, 0.060), (2, 0.064), (3, 0.091), (4, 0.091)), decode_context_s=1e-5)


def _decode(batch: int, context: int, seconds: float, n: int) -> list[StepRecord]:
    return [StepRecord(end=float(i), seconds=seconds, batch=batch, context=context) for i in range(n)]


def test_served_sizes_take_the_served_mean_less_the_context_term():
    steps = _decode(1, 150, 0.0665, 30) + _decode(2, 300, 0.0780, 25) + _decode(3, 450, 0.0855, 20)
    steps += _decode(4, 600, 0.5, 19)  # one short of MIN_STEPS: not re-measured
    steps += [StepRecord(end=0.0, seconds=0.7, new=(100,), cached=(0,), batch=2, context=300)]  # mixed: ignored
    bases = dict((b, t) for b, t, _ in served_bases(PROFILE, steps))
    assert bases[1] == pytest.approx(0.0665 - 150e-5)
    assert bases[2] == pytest.approx(0.0780 - 300e-5)
    assert bases[3] == pytest.approx(0.0855 - 450e-5)
    # batch 4: the profile's base at the window's speed on the served sizes (ratio of sums)
    speed = (30 * 0.0665 + 25 * 0.0780 + 20 * 0.0855) / (30 * (0.060 + 150e-5) + 25 * (0.064 + 300e-5)
                                                        + 20 * (0.091 + 450e-5))
    assert bases[4] == pytest.approx(0.091 * speed)
    shaped = served_profile(PROFILE, steps)
    assert shaped.decode_step_s(3, 450) == pytest.approx(0.0855)  # what the engine served
    assert shaped.prefill_coef == PROFILE.prefill_coef and shaped.decode_context_s == PROFILE.decode_context_s
    assert shaped.meta["served_decode_bases"][0] == [1, pytest.approx(0.0665 - 150e-5), 30]


def test_bases_are_pooled_to_non_decreasing_by_step_counts():
    # served: batch 2 at 70 ms over 90 steps, batch 3 at 64 ms over 30 steps (noise: cheaper than 2)
    steps = _decode(1, 0, 0.060, 100) + _decode(2, 0, 0.070, 90) + _decode(3, 0, 0.064, 30)
    bases = served_bases(PROFILE, steps)
    values = [t for _, t, _ in bases]
    assert values == sorted(values)
    pooled = (90 * 0.070 + 30 * 0.064) / 120
    assert [(b, w) for b, _, w in bases][:3] == [(1, 100), (2, 90), (3, 30)]
    assert values[1] == pytest.approx(pooled) and values[2] == pytest.approx(pooled)


def test_a_window_with_too_few_steps_leaves_the_profile_alone():
    steps = _decode(1, 100, 0.07, 5)
    assert served_bases(PROFILE, steps) == ()
    assert served_profile(PROFILE, steps) is PROFILE
    with pytest.raises(ValueError):
        served_bases(PROFILE, steps, min_steps=0)


def test_an_affine_profile_gets_per_batch_bases():
    affine = ProfiledLatency((0.1, 0.005, 0.0), (0.05, 0.01, 2e-5))  # base(b) = 0.05 + 0.01 b
    shaped = served_profile(affine, _decode(2, 100, 0.080, 40))
    # batch 2 served at 80 - 2 ms; batch 1 (never served) is the affine base at the window's speed
    speed = 0.080 / (0.07 + 100 * 2e-5)
    assert shaped.decode_batch_base == ((1, pytest.approx(0.06 * speed)), (2, pytest.approx(0.078)))
    assert shaped.decode_context_s == 2e-5
    assert shaped.decode_step_s(2, 100) == pytest.approx(0.080)
