"""
compare.py's report: report.md and its plots, from the per-run results compare.py reads out of the
runs' metrics.jsonl. Kept apart so that compare.py reads as the sweep it runs.
"""

import os

import matplotlib

matplotlib.use('Agg')  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def by_variant(results):
    variants = {}
    for r in results:
        variants.setdefault(r['attn_type'], []).append(r)
    return variants


def seed_band(runs, key):
    """x = the eval iterations all seeds share; (mean, min, max) of runs' curve[key] at each."""
    iters = sorted(set.intersection(*[{p['iter'] for p in r['curve']} for r in runs]))
    table = [[next(p for p in r['curve'] if p['iter'] == it)[key] for r in runs] for it in iters]
    return iters, [sum(v) / len(v) for v in table], [min(v) for v in table], [max(v) for v in table]


def write_plots(results, report_dir):
    """val_loss.png (against iterations and training time) and learned.png (sigma / lambda over
    training, where a variant learns them). Returns {name: file name} of the plots written."""
    variants = by_variant(results)
    written = {}
    fig, (ax_it, ax_t) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for i, (attn_type, runs) in enumerate(variants.items()):
        color = f'C{i % 10}'
        iters, mean, low, high = seed_band(runs, 'val_loss')
        _, times, _, _ = seed_band(runs, 'time')
        label = f"{attn_type} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
        ax_it.plot(iters, mean, color=color, label=label, marker='o', markersize=3)
        ax_t.plot([t / 60 for t in times], mean, color=color, label=label, marker='o', markersize=3)
        if len(runs) > 1:
            ax_it.fill_between(iters, low, high, color=color, alpha=0.2)
            ax_t.fill_between([t / 60 for t in times], low, high, color=color, alpha=0.2)
    ax_it.set_xlabel('iteration')
    ax_t.set_xlabel('training time (minutes, evaluation excluded)')
    ax_it.set_ylabel('val loss (cross-entropy, fixed eval batches)')
    ax_it.set_title('val loss: mean over seeds, band = min..max')
    ax_t.set_title('the same against training time')
    for ax in (ax_it, ax_t):
        ax.grid(alpha=0.3)
    ax_it.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(report_dir, 'val_loss.png'), dpi=120)
    plt.close(fig)
    written['val_loss'] = 'val_loss.png'

    learners = {a: runs[0] for a, runs in variants.items() if any(len(p) > 1 for p in runs[0]['learned'])}
    if learners:
        fig, axes = plt.subplots(1, len(learners), figsize=(5 * len(learners), 4), squeeze=False)
        for ax, (attn_type, run) in zip(axes[0], learners.items()):
            name = 'sigma' if 'sigma' in run['learned'][0] else 'lambda'
            iters = [p['iter'] for p in run['learned']]
            n_layer = len(run['learned'][0][name])
            for layer in range(n_layer):
                values = [sum(abs(v) for v in p[name][layer]) / len(p[name][layer]) for p in run['learned']]
                ax.plot(iters, values, label=f'layer {layer}', color=f'C{layer % 10}')
            what = 'mean |sigma| over heads' if name == 'sigma' else 'lambda'
            ax.set_title(f"{attn_type}: {what} (seed {run['seed']})", fontsize=10)
            ax.set_xlabel('iteration')
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(report_dir, 'learned.png'), dpi=120)
        plt.close(fig)
        written['learned'] = 'learned.png'
    return written


def fmt(stat, digits=4):
    if stat['mean'] is None:
        return 'n/a'
    return f"{stat['mean']:.{digits}f}" + (f" ± {stat['std']:.{digits}f}" if stat['std'] is not None else '')


def write_report(report_dir, summary, results, failures, samples, plots, reading, setup):
    base_params = summary.get('base', {}).get('params')
    lines = [
        "# Attention variants compared", "",
        f"Command: `{setup['command']}`  ",
        f"Every run: `{setup['base_config']}`" + (f" with `{setup['overrides']}`" if setup['overrides'] else '')
        + f", {setup['max_iters']} iterations; seeds {', '.join(map(str, setup['seeds']))}. Only attn_type and "
          f"seed differ between runs. Val loss is train.py's evaluation (the same fixed batches for every run); "
          f"mean ± sample standard deviation over seeds.", "",
        "| attn_type | parameters | vs base | final val loss | per seed | best val loss | tokens/s | "
        "peak memory (MiB) | training time (s) | reading |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for attn_type, s in summary.items():
        delta = (f"{s['params'] - base_params:+,} ({(s['params'] - base_params) / base_params:+.2%})"
                 if base_params and attn_type != 'base' else '')
        per_seed = ', '.join(f"{v:.4f}" for v in s['final_val_loss']['values'])
        lines.append(f"| `{attn_type}` | {s['params']:,} | {delta} | {fmt(s['final_val_loss'])} | {per_seed} | "
                     f"{fmt(s['best_val_loss'])} | {fmt(s['tokens_per_s'], 0)} | {fmt(s['peak_memory_mib'], 0)} | "
                     f"{fmt(s['train_time_s'], 1)} | {reading(summary, attn_type)} |")
    lines += ["", "Tokens/s: the median over logged iterations. Peak memory: tensors on CUDA/Gaudi, the "
              "process's peak resident size on CPU. A difference from base no larger than the larger of the "
              "two seed standard deviations is marked as within the spread: more seeds are needed to call it.", ""]
    if setup.get('changes'):
        lines += ["## Settings changed during the sweep", "",
                  "These runs were continued (compare.py --continue_changed=True) with other settings than they "
                  "started with, from the iteration of their checkpoint then:", ""]
        lines += [f"- `{c['attn_type']}` seed {c['seed']}, from iter {c['from_iter']}: " +
                  ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in c['changes'].items())
                  for c in setup['changes']] + [""]
    if 'val_loss' in plots:
        lines += ["## Val loss", "", f"![val loss against iterations and training time]({plots['val_loss']})", ""]
    if 'learned' in plots:
        lines += ["## What the variants learn", "",
                  "NoiseFormer's noise scale sigma (mean |sigma| over the heads of each layer) and DIFF/DINT's "
                  "lambda per layer, at each evaluation of the first seed's run.", "",
                  f"![sigma and lambda over training]({plots['learned']})", ""]
    if samples:
        lines += ["## Samples", "", "One completion per variant (its first seed's checkpoint, sample.py --seed=1337).", ""]
        for attn_type, text in samples.items():
            fence = '`' * max(3, 1 + max((len(run) for run in text.split('\n') if set(run) == {'`'}), default=0))
            lines += [f"### `{attn_type}`", "", f"{fence}text", text, fence, ""]
    if failures:
        lines += ["## Failed runs", ""] + [f"- `{a}` seed {s}: {why}" for (a, s), why in failures.items()] + [""]
    with open(os.path.join(report_dir, 'report.md'), 'w') as f:
        f.write('\n'.join(lines))
