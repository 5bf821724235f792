"""Per-phase engine speed from step records against a profile (step_clock.py)."""

from __future__ import annotations

import pytest

from pdserve.engine.step_log import StepRecord
from pdserve.validate.step_clock import StepSpeed, drift, modelled_parts, step_speed
from pdserve.latency.profiled import ProfiledLatency

PROFILE = ProfiledLatency((0.05, 1e-3, 1e-7), (0.03, 0.004, 2e-6), decode_batch_base=((1, 0.03), (4, 0.045), (8, 0.07)),
                          decode_context_s=2e-6)


def _ran(shape: tuple, prefill: float, decode: float) -> StepRecord:
    """A step of `shape` = (new, cached, batch, context) that took exactly the scaled profile's time."""
    p, d = modelled_parts(PROFILE, StepRecord(0.0, 0.0, *shape))
    return StepRecord(0.0, prefill * p + decode * d, *shape)


DISAGG = [((64,), (0,), 0, 0), ((128, 32), (0, 0), 0, 0), ((200,), (64,), 0, 0),
          ((), (), 1, 70), ((), (), 3, 400), ((), (), 6, 900), ((), (), 8, 2000)]
MIXED = [((64,), (0,), 2, 300), ((16,), (48,), 5, 800), ((100,), (0,), 1, 90), ((), (), 4, 500), ((), (), 2, 260)]


@pytest.mark.parametrize("shapes", [DISAGG, MIXED], ids=["phase steps", "colocated steps"])
def test_factors_of_an_exactly_scaled_engine_are_recovered(shapes):
    speed = step_speed(PROFILE, [_ran(s, 1.25, 0.9) for s in shapes])
    assert speed.prefill_factor == pytest.approx(1.25, rel=1e-9)
    assert speed.decode_factor == pytest.approx(0.9, rel=1e-9)
    assert speed.prefill_steps == sum(1 for s in shapes if s[0])
    assert speed.decode_steps == sum(1 for s in shapes if s[2])


def test_the_modelled_parts_are_what_the_scaled_profile_charges():
    from pdserve.validate.calibrate import scaled
    from pdserve.latency.base import causal_pairs

    slow = scaled(PROFILE, 1.3, 0.8)
    p, d = modelled_parts(PROFILE, StepRecord(0.0, 0.0, (16, 20), (48, 0), 5, 800))
    pairs = causal_pairs(16, 48) + causal_pairs(20, 0)
    assert 1.3 * p + 0.8 * d == pytest.approx(slow.mixed_step_s(36, pairs, 0, 0.0, 5, 800), rel=1e-12)
    p, d = modelled_parts(PROFILE, StepRecord(0.0, 0.0, (), (), 6, 900))
    assert (p, 0.8 * d) == (0.0, pytest.approx(slow.decode_step_s(6, 900), rel=1e-12))


def test_a_phase_without_steps_has_no_factor_and_no_drift():
    only_decode = step_speed(PROFILE, [_ran(s, 1.0, 1.1) for s in DISAGG if not s[0]])
    assert only_decode.prefill_factor is None and only_decode.decode_factor == pytest.approx(1.1)
    assert step_speed(PROFILE, []) == StepSpeed(None, None, 0, 0)
    decode_steps = [_ran(s, 1.0, 1.1) for s in DISAGG if not s[0]]
    assert drift(PROFILE, decode_steps, decode_steps) == (1.0, 1.0)  # no prefill class in both: 1.0


def test_drift_compares_matched_shapes_only():
    """The engine runs 3-row decode steps at 0.8x what the profile says (a shape error of the
    profile) and the machine is 1.2x slower in prefill and 1.1x in decode in the second window,
    which ran mostly 3-row steps. Step speed against the profile mixes the shape error into the
    window's factor; matched-shape drift finds the machine's 1.2 and 1.1 exactly. A class only one
    window ran (8 rows) is left out."""
    def engine(shape, prefill, decode):
        step = _ran(shape, prefill, decode)
        return StepRecord(0.0, step.seconds * (0.8 if shape[2] == 3 else 1.0), *shape)

    one, three, eight = ((), (), 1, 100), ((), (), 3, 300), ((), (), 8, 900)
    prompts = [((64,), (0,), 0, 0), ((512,), (512,), 0, 0)]
    reference = [engine(s, 1.0, 1.0) for s in [one] * 8 + [three] * 2 + prompts]
    window = [engine(s, 1.2, 1.1) for s in [one] * 2 + [three] * 8 + [eight] + prompts * 2]
    assert drift(PROFILE, window, reference) == (pytest.approx(1.2), pytest.approx(1.1))
    mixed = step_speed(PROFILE, window).decode_factor / step_speed(PROFILE, reference).decode_factor
    assert abs(mixed - 1.1) > 0.02  # what comparing unmatched totals would have said


def test_a_stalled_step_counts_for_the_time_it_took():
    """The window's speed is its steps' total time over the profile's: a 0.5 s stall is time the
    window's requests waited, so it slows the decode factor by 0.5 s over the decode steps' total."""
    steps = [_ran(s, 1.0, 1.0) for s in DISAGG]
    decode_total = sum(modelled_parts(PROFILE, s)[1] for s in steps)
    steps[3] = StepRecord(0.0, steps[3].seconds + 0.5, *DISAGG[3])
    assert step_speed(PROFILE, steps).decode_factor == pytest.approx(1.0 + 0.5 / decode_total)
