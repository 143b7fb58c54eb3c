"""The learning-rate schedule (denoised_gpt/lr_schedule.py): linear warmup, cosine decay to min_lr,
then min_lr; values from the formula, written out here; and the settings it refuses."""
import math

import pytest

from denoised_gpt.lr_schedule import check_schedule, get_lr


def test_lr_schedule_warmup_cosine_floor():
    lr, warmup, decay, min_lr = 6e-4, 2000, 600000, 6e-5
    f = lambda it: get_lr(it, lr, warmup, decay, min_lr)  # noqa: E731
    assert f(0) == pytest.approx(lr * 1 / 2001)
    assert f(999) == pytest.approx(lr * 1000 / 2001)
    assert f(1999) == pytest.approx(lr * 2000 / 2001)
    assert f(2000) == pytest.approx(lr)  # end of warmup: cos(0) = 1
    mid = (warmup + decay) // 2
    assert f(mid) == pytest.approx(min_lr + 0.5 * (lr - min_lr))  # cos(pi/2) = 0
    r = (100000 - warmup) / (decay - warmup)
    assert f(100000) == pytest.approx(min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (lr - min_lr))
    assert f(decay) == pytest.approx(min_lr)  # cos(pi) = -1
    assert f(decay + 1) == min_lr and f(10 * decay) == min_lr
    values = [f(it) for it in range(0, decay + 2000, 997)]
    peak = values.index(max(values))
    assert all(a <= b for a, b in zip(values[:peak], values[1:peak + 1]))  # up, then
    assert all(a >= b for a, b in zip(values[peak:], values[peak + 1:]))  # down
    assert get_lr(0, lr, 0, decay, min_lr) == lr  # no warmup


def test_lr_schedule_rejects_impossible_settings():
    with pytest.raises(ValueError, match="lr_decay_iters=100 must be larger than warmup_iters=100"):
        check_schedule(6e-4, 100, 100, 6e-5)
    with pytest.raises(ValueError, match=r"give a shorter warmup, e\.g\. --warmup_iters=5 \(below max_iters\)"):
        check_schedule(6e-4, 50, 50, 6e-5)  # a short run cut from a config that warms up for 50
    with pytest.raises(ValueError, match="give a larger lr_decay_iters"):
        check_schedule(6e-4, 0, 0, 6e-5)
    with pytest.raises(ValueError, match="min_lr"):
        check_schedule(6e-4, 10, 100, 1e-3)
    with pytest.raises(ValueError, match="warmup_iters"):
        check_schedule(6e-4, -1, 100, 6e-5)
    check_schedule(6e-4, 2000, 600000, 6e-5)
