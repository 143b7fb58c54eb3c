"""
The learning-rate schedule of nanoGPT / GPT-3: linear warmup, cosine decay, then a constant floor.

    it < warmup_iters:                 lr * (it + 1) / (warmup_iters + 1)
    warmup_iters <= it <= decay_iters: min_lr + 0.5 * (1 + cos(pi * r)) * (lr - min_lr),
                                       r = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    it > lr_decay_iters:               min_lr

The warmup starts at lr / (warmup_iters + 1), not 0, so iteration 0 already moves the weights.
"""

import math


def check_schedule(learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """Raise ValueError for a schedule that cannot be evaluated; train.py calls it once at startup."""
    if warmup_iters < 0:
        raise ValueError(f"warmup_iters={warmup_iters} must be >= 0")
    if lr_decay_iters <= warmup_iters:
        # a short run (max_iters and lr_decay_iters cut together) inherits its config's warmup: shorten that
        fix = (f"for a run this short give a shorter warmup, e.g. --warmup_iters={lr_decay_iters // 10} (below "
               f"max_iters)" if lr_decay_iters >= 2 else "give a larger lr_decay_iters, e.g. max_iters")
        raise ValueError(f"lr_decay_iters={lr_decay_iters} must be larger than warmup_iters={warmup_iters} "
                         f"(the cosine runs from the end of warmup to lr_decay_iters): {fix}; "
                         f"for a constant learning rate set decay_lr=False")
    if not 0 <= min_lr <= learning_rate:
        raise ValueError(f"min_lr={min_lr} must be between 0 and learning_rate={learning_rate}")


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """Learning rate for iteration `it` (0-based)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 at the end of warmup, 0 at lr_decay_iters
    return min_lr + coeff * (learning_rate - min_lr)
