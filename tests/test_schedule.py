"""BatchSizeSchedule and LearningRateRule against hand-computed closed forms (no TensorFlow needed)."""
import math

import pytest

from torus.integrations.keras.training.schedule import BatchSizeSchedule, LearningRateRule


def test_batch_schedule_lookup_and_string_form():
    s = BatchSizeSchedule("0:256, 5:512,9:1024")
    assert [s.global_batch(e) for e in (0, 4, 5, 8, 9, 100)] == [256, 256, 512, 512, 1024, 1024]
    assert BatchSizeSchedule({5: 512, 0: 256, 9: 1024}).get_config() == s.get_config()
    assert BatchSizeSchedule.from_config(s.get_config()).get_config() == {"schedule": "0:256,5:512,9:1024"}
    assert s.per_rank_batch(5, 4) == 128 and s.per_rank_batch(0, 1) == 256
    assert s.segments(12) == [(0, 5, 256), (5, 9, 512), (9, 12, 1024)]
    assert s.segments(7, initial_epoch=2) == [(2, 5, 256), (5, 7, 512)]
    assert s.segments(5, initial_epoch=5) == []


def test_batch_schedule_steps_drop_remainder():
    s = BatchSizeSchedule({0: 64, 2: 100})
    assert s.steps_per_epoch(0, 1000) == 15  # 1000 // 64
    assert s.steps_per_epoch(3, 1000) == 10
    assert s.steps_per_epoch(3, 1099) == 10
    with pytest.raises(ValueError, match="epoch 3"):
        s.steps_per_epoch(3, 99)


def test_batch_schedule_errors_name_epoch_and_size():
    s = BatchSizeSchedule({0: 64, 2: 96})
    with pytest.raises(ValueError, match=r"96 at epoch 2 does not divide into 5 ranks"):
        s.per_rank_batch(2, 5)
    for bad in ({1: 64}, {0: 0}, "0:64,x", {}):
        with pytest.raises(ValueError):
            BatchSizeSchedule(bad)


def test_lr_linear_scaling_and_warmup():
    rule = LearningRateRule(0.1, base_batch=256, warmup_epochs=5, decay="none")
    assert rule.peak(1024) == pytest.approx(0.4)
    assert rule.lr(0.0, 1024) == 0.0
    assert rule.lr(2.5, 1024) == pytest.approx(0.2)
    assert rule.lr(5.0, 1024) == pytest.approx(0.4)
    assert rule.lr(50.0, 512) == pytest.approx(0.2)


def test_lr_poly_decay_closed_form():
    rule = LearningRateRule(2.0, base_batch=512, warmup_epochs=2, decay="poly", total_epochs=10, power=2.0,
                            min_lr=0.01)
    peak = 2.0 * 2048 / 512
    for e in (2.0, 3.7, 6.0, 9.99):
        want = 0.01 + (peak - 0.01) * (1 - (e - 2) / 8) ** 2
        assert math.isclose(rule.lr(e, 2048), want, rel_tol=1e-12)
    assert rule.lr(10.0, 2048) == pytest.approx(0.01)
    assert rule.lr(12.0, 2048) == pytest.approx(0.01)
    assert rule.lr(1.0, 2048) == pytest.approx(peak / 2)


def test_lr_step_decay_closed_form():
    rule = LearningRateRule(0.1, warmup_epochs=0, decay="step", step_epochs=(30, 60, 80), step_factor=0.1,
                            min_lr=1e-5)
    got = [rule.lr(e, 256) for e in (0, 29.9, 30, 59, 60, 80, 90)]
    assert got == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 1e-4, 1e-4])
    tiny = LearningRateRule(0.1, decay="step", step_epochs=(1, 2, 3), step_factor=0.01, min_lr=1e-5)
    assert tiny.lr(3.0, 256) == 1e-5


def test_lr_config_round_trip_and_errors():
    rule = LearningRateRule(0.3, base_batch=128, warmup_epochs=1.5, decay="step", step_epochs=(3, 5))
    again = LearningRateRule.from_config(rule.get_config())
    assert again.get_config() == rule.get_config()
    assert [again.lr(e, 512) for e in (0.7, 4.0)] == [rule.lr(e, 512) for e in (0.7, 4.0)]
    with pytest.raises(ValueError):
        LearningRateRule(0.1, decay="cosine")
    with pytest.raises(ValueError):
        LearningRateRule(0.1, decay="poly", warmup_epochs=5, total_epochs=5)
