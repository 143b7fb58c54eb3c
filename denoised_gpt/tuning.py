"""
compare.py's tuning: each attention variant trained at its own best settings before the variants are
compared, as the field compares sequence mixers (Zoology sweeps the learning rate for every mixer and
reports each at its best). A variant compared at settings chosen for another is compared at a handicap
of unknown size.

`tune` maps train.py settings to the values to try ({'learning_rate': [1e-3, 3e-3, 1e-2]}); every
combination is a candidate. compare.py trains each candidate for every variant on the tuning seeds
(never the comparison's seeds, so the comparison does not reuse the runs its settings were picked on),
chooses the candidate with the best selection metric, and trains the comparison at it.
"""

import itertools
import math

METRICS = ('val_loss', 'accuracy')  # final val loss (lower is better); answer accuracy on recall data (higher)


def candidates(tune):
    """{key: [values]} -> every combination as {key: value}, the first key varying slowest."""
    keys = list(tune)
    return [dict(zip(keys, values)) for values in itertools.product(*(tune[k] for k in keys))]


def variant_tune(tune, attn_type):
    """The {key: [values]} that `tune` gives attn_type: a key whose values are given per variant
    ({attn_type: [values]}) takes that variant's list."""
    return {key: values[attn_type] if isinstance(values, dict) else values for key, values in tune.items()}


def candidate_settings(candidate, config):
    """The train.py settings a candidate gives a run whose other settings are `config`. A learning rate
    tuned without min_lr takes min_lr along at the config's ratio (nanoGPT's min_lr = learning_rate / 10):
    a fixed min_lr above a smaller learning rate would turn the cosine decay into a rise."""
    settings = dict(candidate)
    if 'learning_rate' in candidate and 'min_lr' not in candidate and config['learning_rate']:
        # the ratio first: a rate times a ratio <= 1 never rounds above the rate (train.py refuses min_lr > it)
        settings['min_lr'] = candidate['learning_rate'] * (config['min_lr'] / config['learning_rate'])
    return settings


def candidate_args(settings):
    return [f"--{key}={value!r}" for key, value in settings.items()]


def candidate_label(candidate):
    """'learning_rate=0.003' (several keys joined by spaces): the candidate's name in tables."""
    return ' '.join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                    for key, value in candidate.items())


def candidate_tag(candidate):
    """The candidate in a folder name: 'learning_rate0.003'."""
    return '-'.join(f"{key}{value:g}" if isinstance(value, float) else f"{key}{value}"
                    for key, value in candidate.items())


def score(runs, metric):
    """A candidate's score from its tuning runs' results ({'final_val_loss', 'final_iter', 'reached_target',
    'accuracy'}, or None for a run that failed or diverged): {'val_loss', 'accuracy', 'iters'} means over
    the seeds, 'reached' when every seed ended at train.py's stop_at_val_loss, and 'diverged' when any seed
    did not finish with a finite loss (such a candidate ranks below every other)."""
    finite = [r for r in runs if r is not None and math.isfinite(r['final_val_loss'])]
    out = {'diverged': len(finite) < len(runs)}
    if not out['diverged']:
        mean = lambda key: sum(r[key] for r in finite) / len(finite)  # noqa: E731
        out.update(val_loss=mean('final_val_loss'), iters=mean('final_iter'),
                   reached=all(r['reached_target'] for r in finite))
        if metric == 'accuracy':
            out['accuracy'] = mean('accuracy')
    return out


def rank_key(scored, metric):
    """Sort key, best first. A candidate that reached stop_at_val_loss on every seed beats one that did not,
    and sooner beats later (stopped there, its final metric says only that it got there); the others rank
    by higher accuracy with ties broken by lower val loss, or by lower val loss."""
    if scored['diverged']:
        return (2, 0.0, 0.0, 0.0)
    if scored['reached']:
        return (0, scored['iters'], 0.0, scored['val_loss'])
    return (1, 0.0, -scored['accuracy'] if metric == 'accuracy' else 0.0, scored['val_loss'])


def choose(scores, metric):
    """Index of the best of the candidates' scores (the first of equals). None when every one diverged."""
    best = min(range(len(scores)), key=lambda i: rank_key(scores[i], metric))
    return None if scores[best]['diverged'] else best


def outranked(candidates_so_far):
    """Which candidates can no longer be chosen, given each one's tuning runs so far: per candidate, per seed,
    (the iteration of its last evaluation or None before the first, whether it stopped there at
    stop_at_val_loss); None for a seed that diverged. A candidate that reached the target on every seed at
    n iterations on average ranks above every one that gets there later; a seed still short of the target
    can only get there after its last evaluation, so a candidate whose every seed has started and whose
    iterations so far already average n or more cannot beat it and need not train on. Returns the indices
    of those candidates, and n (None when no candidate has reached the target)."""
    def mean_iters(runs):
        return sum(i for i, _ in runs) / len(runs)
    reached = [mean_iters(runs) for runs in candidates_so_far if all(r is not None and r[1] for r in runs)]
    if not reached:
        return [], None
    best = min(reached)
    return [c for c, runs in enumerate(candidates_so_far)
            if all(r is not None and r[0] is not None for r in runs) and not all(r[1] for r in runs)
            and mean_iters(runs) >= best], best


def edge_warnings(tune, chosen):
    """For each tuned key with numbers to choose from: a warning when the chosen value is the smallest or
    the largest tried, since the best may then lie outside the range."""
    warnings = []
    for key, values in tune.items():
        numbers = sorted({v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if len(numbers) < 2 or chosen[key] not in (numbers[0], numbers[-1]):
            continue
        low = chosen[key] == numbers[0]
        warnings.append(f"{key}={chosen[key]:g} is the {'smallest' if low else 'largest'} value tried: the best may "
                        f"lie {'below' if low else 'above'} it; extend the range {'down' if low else 'up'}")
    return warnings
