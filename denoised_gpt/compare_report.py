"""
compare.py's report: report.md and its plots, from the per-run results compare.py reads out of the
runs' metrics.jsonl, and the paired comparison of each variant with base that the report's reading
rests on. Kept apart so that compare.py reads as the sweep it runs.
"""

import os

import matplotlib

from denoised_gpt.evaluation import mean_std
from denoised_gpt.evaluation.attention_noise import PART_WORDS
from denoised_gpt.files import write_atomically

matplotlib.use('Agg')  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def paired_vs_base(results, variant, base='base', key='final_val_loss'):
    """variant's final val loss (or another per-run number: key) minus base's, seed by seed, over the
    seeds both finished. Results name their variant in 'variant' (attn_type, and the grid point if any).

    Runs with the same seed share their data order and evaluation batches, so much of the seed-to-seed
    variation is common to both and cancels in the difference: a small difference that holds on every
    seed can hide inside the unpaired spreads, and a mean difference can come from seeds that disagree.
    Returns {'seeds', 'differences', 'mean', 'std', 'same_sign'}: mean and sample std as mean_std
    gives them (std None for one seed, both None for none); same_sign is whether every difference is
    non-zero and of one sign (trivially so for one seed, False for none)."""
    base_value = {r['seed']: r[key] for r in results if r['variant'] == base}
    seeds = [r['seed'] for r in results if r['variant'] == variant and r['seed'] in base_value]
    differences = [next(r[key] for r in results if (r['variant'], r['seed']) == (variant, s))
                   - base_value[s] for s in seeds]
    stat = mean_std(differences)
    same_sign = bool(differences) and (all(d < 0 for d in differences) or all(d > 0 for d in differences))
    return {'seeds': seeds, 'differences': differences, 'mean': stat['mean'], 'std': stat['std'],
            'same_sign': same_sign}


def reading(paired):
    """Plain words for a paired_vs_base result. A difference is only called lower or higher when every
    seed agrees in sign; the mean alone never decides it, since seeds that disagree mean no consistent
    difference whatever the mean is."""
    n = len(paired['differences'])
    if n == 0:
        return "no seed finished by both it and base: nothing to compare"
    if n == 1:
        return (f"{paired['mean']:+.4f} vs base (seed {paired['seeds'][0]}), one seed: "
                f"no spread to judge it against")
    stat = f"{paired['mean']:+.4f} ± {paired['std']:.4f}"
    if not paired['same_sign']:
        lower = sum(d < 0 for d in paired['differences'])
        return f"no consistent difference: signs differ across seeds (lower on {lower}/{n}; {stat})"
    return f"{'lower' if paired['mean'] < 0 else 'higher'} than base on every seed ({n}/{n}): {stat}"


def paired_cell(paired, digits=3):
    """A paired_vs_base result in a table cell: mean ± std, marked * where two or more seeds agree in sign (one
    seed agrees with itself, which says nothing); '' where no seed was paired."""
    if not paired or paired['mean'] is None:
        return ''
    agreed = paired['same_sign'] and len(paired['differences']) > 1
    return (f"{paired['mean']:+.{digits}f}" + (f" ± {paired['std']:.{digits}f}" if paired['std'] is not None else '')
            + ('*' if agreed else ''))


def by_variant(results):
    variants = {}
    for r in results:
        variants.setdefault(r['variant'], []).append(r)
    return variants


def seed_band(runs, key):
    """x = the eval iterations all seeds share; (mean, min, max) of runs' curve[key] at each."""
    iters = sorted(set.intersection(*[{p['iter'] for p in r['curve']} for r in runs]))
    table = [[next(p for p in r['curve'] if p['iter'] == it)[key] for r in runs] for it in iters]
    return iters, [sum(v) / len(v) for v in table], [min(v) for v in table], [max(v) for v in table]


def seed_tails(runs, shared_iters):
    """Each run's curve points from the last iteration all seeds share to its own end, for the runs that went
    on past it (runs that stop at a target end at different iterations): [(iters, val losses, times)]."""
    if not shared_iters:
        return []
    last = shared_iters[-1]
    tails = []
    for r in runs:
        points = [p for p in r['curve'] if p['iter'] >= last]
        if len(points) > 1:
            tails.append(([p['iter'] for p in points], [p['val_loss'] for p in points], [p['time'] for p in points]))
    return tails


# how to write the report again after a failed write (files.write_atomically's remedy goes on with it)
WRITE_AGAIN = " and run the same command with --report_only=True (the runs are intact)"


def save_png(fig, path):
    """fig as a PNG at path, written whole or not at all (FileError, one line, on a failed write), and closed."""
    try:
        write_atomically(path, lambda f: fig.savefig(f, format='png', dpi=120), binary=True, then=WRITE_AGAIN)
    finally:
        plt.close(fig)


TITLE_SIZE = 10  # every panel title of the report's plots, and a figure's own title


def val_loss_figure(variants):
    """val_loss.png's figure: each variant's val loss (variants: by_variant's) against iterations and against
    training time, one title over both panels for what they share."""
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
        for tail_iters, tail_loss, tail_times in seed_tails(runs, iters):  # a seed that trained on alone
            ax_it.plot(tail_iters, tail_loss, color=color, linewidth=0.8, alpha=0.6)
            ax_t.plot([t / 60 for t in tail_times], tail_loss, color=color, linewidth=0.8, alpha=0.6)
    ax_it.set_xlabel('iteration')
    ax_t.set_xlabel('training time (minutes, evaluation excluded)')
    ax_it.set_ylabel('val loss (cross-entropy, fixed eval batches)')
    fig.suptitle('val loss: mean over seeds, band = min..max; thin: a seed past the iterations all seeds reached',
                 fontsize=TITLE_SIZE)
    ax_it.set_title('against iterations', fontsize=TITLE_SIZE)
    ax_t.set_title('against training time', fontsize=TITLE_SIZE)
    for ax in (ax_it, ax_t):
        ax.grid(alpha=0.3)
    ax_it.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_plots(results, report_dir):
    """val_loss.png (against iterations and training time) and learned.png (sigma / lambda over
    training, where a variant learns them). Returns {name: file name} of the plots written."""
    variants = by_variant(results)
    written = {}
    save_png(val_loss_figure(variants), os.path.join(report_dir, 'val_loss.png'))
    written['val_loss'] = 'val_loss.png'

    if any('accuracy_by_pairs' in r for r in results):
        written['accuracy'] = plot_accuracy(results, report_dir)
    if any('answer_share' in r for r in results):
        written['attention'] = plot_against_filler(results, report_dir)
    if any('copy_accuracy' in r for r in results):
        written['retrieval'] = plot_retrieval(results, report_dir)

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
            ax.set_title(f"{attn_type}: {what} (seed {run['seed']})", fontsize=TITLE_SIZE)
            ax.set_xlabel('iteration')
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        save_png(fig, os.path.join(report_dir, 'learned.png'))
        written['learned'] = 'learned.png'
    return written


def plot_accuracy(results, report_dir):
    """accuracy.png: answer accuracy against the number of key-value pairs, one line per attn_type (mean
    over seeds, bars = min..max), one panel per grid point."""
    points = list(dict.fromkeys(r['point'] for r in results if 'accuracy_by_pairs' in r))
    attn_types = list(dict.fromkeys(r['attn_type'] for r in results))
    fig, axes = plt.subplots(1, len(points), figsize=(5.5 * len(points), 4.5), squeeze=False, sharey=True)
    for ax, point in zip(axes[0], points):
        for i, attn_type in enumerate(attn_types):
            runs = [r for r in results if r['point'] == point and r['attn_type'] == attn_type and 'accuracy_by_pairs' in r]
            if not runs:
                continue
            pairs = sorted(runs[0]['accuracy_by_pairs'], key=int)
            table = [[r['accuracy_by_pairs'][p] for r in runs] for p in pairs]
            mean = [sum(v) / len(v) for v in table]
            x = [int(p) * (1 + 0.015 * (i - len(attn_types) / 2)) for p in pairs]  # a small shift keeps bars apart
            ax.errorbar(x, mean, yerr=[[m - min(v) for m, v in zip(mean, table)], [max(v) - m for m, v in zip(mean, table)]],
                        color=f'C{i % 10}', marker='o', markersize=4, capsize=3, label=attn_type)
        ax.set_xscale('log', base=2)
        ax.set_xlabel('key-value pairs per example')
        ax.set_title(point or 'answer accuracy', fontsize=TITLE_SIZE)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel('answer accuracy (mean over seeds, bars = min..max)')
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, os.path.join(report_dir, 'accuracy.png'))
    return 'accuracy.png'


def plot_against_filler(results, report_dir):
    """attention.png: answer accuracy, the lookup head's signed value share, the reading layer's, and the
    reading layer's share on noise (other pairs, earlier queries and filler) against the examples' filler
    length (the grid points' datasets), one line per attn_type: mean over seeds, bars = min..max. The lines
    are shifted apart sideways a little, so that bars at one length do not hide each other."""
    lines, words = filler_lines(results), data_words(results)
    lengths = sorted({r['filler_length'] for line in lines.values() for r in line})
    shift = 0.012 * ((lengths[-1] - lengths[0]) or 1) if lengths else 0
    fig, axes = plt.subplots(1, 4, figsize=(24, 4.5))
    for ax, key, what in ((axes[0], 'accuracy', 'answer accuracy'),
                          (axes[1], 'signed_value_share', "lookup head's signed share on the answer value"),
                          (axes[2], 'layer_signed_value_share', "reading layer's signed share on the answer value"),
                          (axes[3], 'layer_noise_share', "reading layer's share on noise")):
        for i, (label, line) in enumerate(lines.items()):
            runs = [r for r in line if key in r]
            fillers = sorted({r['filler_length'] for r in runs})
            table = [[r[key] for r in runs if r['filler_length'] == f] for f in fillers]
            if not table:
                continue
            mean = [sum(v) / len(v) for v in table]
            x = [f + shift * (i - (len(lines) - 1) / 2) for f in fillers]
            ax.errorbar(x, mean, yerr=[[m - min(v) for m, v in zip(mean, table)],
                                       [max(v) - m for m, v in zip(mean, table)]],
                        color=f'C{i % 10}', marker='o', markersize=4, capsize=3, label=label)
        ax.set_xticks(lengths)
        ax.set_xlabel(f"{words['filler']} tokens per example (neither {words['unit']} nor queries)")
        ax.set_ylabel(f'{what}\n(mean over seeds, bars = min..max)')
        ax.set_ylim(0, 1.02 if key != 'layer_noise_share' else None)  # the noise's share: small, zoomed in
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, os.path.join(report_dir, 'attention.png'))
    return 'attention.png'


def distances(run):
    """The retrieval probe's distances in a run's results (its 'copy_accuracy@D' keys), in order."""
    return sorted(int(k.split('@')[1]) for k in run if k.startswith('copy_accuracy@'))


def plot_retrieval(results, report_dir):
    """retrieval.png: copy accuracy, the copy head's signed share on the token to copy and the reading layer's share
    on noise (the rest of the span and the text) against the distance between the two copies, one line per
    variant: mean over seeds, bars = min..max, shifted apart sideways a little."""
    variants = {v: [r for r in runs if 'copy_accuracy' in r] for v, runs in by_variant(results).items()}
    variants = {v: runs for v, runs in variants.items() if runs}
    fig, axes = plt.subplots(3, 1, figsize=(8, 10), sharex=True)  # one above the other: 960 px wide, a page's width
    for ax, key, what in ((axes[0], 'copy_accuracy', 'copy accuracy'),
                          (axes[1], 'copy_signed_copy_share', "copy head's signed share\non the token to copy"),
                          (axes[2], 'copy_layer_noise_share', "reading layer's share on noise")):
        for i, (variant, runs) in enumerate(variants.items()):
            ds = distances(runs[0])
            table = [[r[f'{key}@{d}'] for r in runs] for d in ds]
            mean = [sum(v) / len(v) for v in table]
            x = [d * (1 + 0.03 * (i - (len(variants) - 1) / 2)) for d in ds]
            ax.errorbar(x, mean, yerr=[[m - min(v) for m, v in zip(mean, table)], [max(v) - m for m, v in zip(mean, table)]],
                        color=f'C{i % 10}', marker='o', markersize=4, capsize=3, label=variant)
        if key == 'copy_accuracy':
            chance = next(iter(variants.values()))[0]['copy_chance']
            ax.axhline(chance, color='grey', linestyle=':', linewidth=1, label=f'chance ({chance:.3f})')
        ax.set_xscale('log', base=2)
        ax.set_ylabel(f'{what}\n(mean over seeds, bars = min..max)')
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel('tokens of text between the two copies')
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, os.path.join(report_dir, 'retrieval.png'))
    return 'retrieval.png'


def retrieval_lines(summary, results, plots):
    """The report's section on the retrieval probe (compare.py's retrieval), or [] without it."""
    probed = {v: s for v, s in summary.items() if 'copy_accuracy' in s}
    if not probed:
        return []
    first = next(r for r in results if 'copy_accuracy' in r)
    ds = distances(first)
    lines = ["## Copying a span from the text (retrieval probe)", "",
             "eval.py --retrieval=True on each run's checkpoint (docs/eval.md): windows of the validation text with a "
             "span of random tokens written twice, D tokens of text between (the same examples for every run); copy "
             "accuracy is the share of the second copy's tokens (after its first) that the most likely next token "
             f"gets right; chance is about {first['copy_chance']:.4f} (1 over the token ids of the file). Mean ± sample "
             "standard deviation over seeds; reading: minus base's, seed by seed, as for the val loss.", ""]
    at = [f"D={d}" for d in ds]
    lines += table(['variant', 'copy accuracy', 'per seed', *at, 'reading'],
                   [[f"`{variant}`", fmt(s['copy_accuracy'], 3), per_seed(s['copy_accuracy']),
                     *(fmt(s[f'copy_accuracy@{d}'], 3) for d in ds), paired_reading(s, 'copy_accuracy')]
                    for variant, s in probed.items()])
    paired = {v: s for v, s in probed.items() if 'copy_accuracy_vs_base' in s}
    if paired:
        lines += ["", "Copy accuracy minus base's at each distance, seed by seed (mean ± std; * two or more seeds, "
                  "all the same sign):", ""]
        lines += table(['variant', *at], [[f"`{variant}`", *(paired_cell(s.get(f'copy_accuracy@{d}_vs_base'))
                                                              for d in ds)] for variant, s in paired.items()])
    for where, prefix, what, chosen in (
            ('copy head', 'copy_', "the layer and head with the highest mean signed share on the token to copy over "
             "every distance (among the variant's own heads)", 'copy_head'),
            ('reading layer', 'copy_layer_', "the layer whose output takes the most signed share from the token to "
             "copy, by what each key adds to it (all heads, through the values and c_proj)", 'copy_reading_layer')):
        lines += ["", f"Where attention goes while copying, at each run's {where}: {what}. Shares of the absolute "
                  "mass: the source (the earlier occurrence of the query's token and the token to copy), each apart, "
                  "the rest of the span, the query's own token, the text; noise = span + text; signed: negative "
                  "where it subtracts. Over every distance, and the noise share at each distance.", ""]
        lines += table(
            ['variant', f'{where} per seed', 'source (signed)', 'token to copy (signed)', 'earlier occurrence (signed)',
             'span', 'own token', 'text', 'noise', *(f"noise D={d}" for d in ds), 'reading (signed token to copy)',
             'reading (noise)'],
            [[f"`{variant}`", ', '.join(r[chosen] for r in results if r['variant'] == variant and chosen in r),
              *(f"{fmt(s[f'{prefix}{part}_share'], 3)} ({fmt(s[f'{prefix}signed_{part}_share'], 3)})"
                for part in ('source', 'copy', 'occurrence')),
              *(fmt(s[f'{prefix}{part}_share'], 3) for part in ('span', 'own', 'text', 'noise')),
              *(fmt(s[f'{prefix}noise_share@{d}'], 3) for d in ds),
              paired_reading(s, f'{prefix}signed_copy_share'), paired_reading(s, f'{prefix}noise_share')]
             for variant, s in probed.items()])
    lines.append("")
    if 'retrieval' in plots:
        lines += [f"![copy accuracy, signed share on the token to copy and noise share against distance]"
                  f"({plots['retrieval']})", ""]
    return lines


def paired_reading(summary, key):
    """reading() of a variant's key against base (summarize's f'{key}_vs_base'); '' for base itself."""
    return reading(summary[f'{key}_vs_base']) if f'{key}_vs_base' in summary else ''


def table(header, rows):
    """A Markdown table's lines: the header's cells, the rule under them, then each row's cells."""
    return (['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
            + ['| ' + ' | '.join(row) + ' |' for row in rows])


def per_seed(stat, digits=3):
    """A statistic's values, seed by seed."""
    return ', '.join(f'{v:.{digits}f}' for v in stat['values'])


def fmt(stat, digits=4):
    if stat['mean'] is None:
        return 'n/a'
    return f"{stat['mean']:.{digits}f}" + (f" ± {stat['std']:.{digits}f}" if stat['std'] is not None else '')


METRIC_WORDS = {'val_loss': "the lowest final val loss",
                'accuracy': "the highest answer accuracy (ties broken by the lower final val loss)"}


def protocol_lines(protocol, tuning):
    """The report's first words: how the variants' settings were chosen, and (tuned) every candidate's score."""
    def named(settings):
        return ', '.join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in settings.items())
    if protocol.get('chosen'):
        own = '; '.join(f"`{a}` {named(v)}" for a, v in protocol['chosen'].items())
        rates = any('learning_rate' in v for v in protocol['chosen'].values())  # min_lr follows each rate
        ratio = " (min_lr at the config's ratio to each rate)" if rates else ""
        shared = {k: v for k, v in protocol['settings'].items()
                  if not any(k in v for v in protocol['chosen'].values()) and not (rates and k == 'min_lr')}
        return [f"**Protocol: each variant at the settings an earlier tuning chose for it** ({protocol['chosen_by']}): "
                f"{own}{ratio}; not tuned again here. The rest the same for every variant ({named(shared)}). "
                "A difference below holds at these settings.", ""]
    if not protocol['tuned']:
        return [f"**Protocol: the same settings for every variant** ({named(protocol['settings'])}); none was tuned "
                "for any variant. A difference below holds at these settings only: a variant may do better at others (compare.py's "
                "`tune` trains each variant at its own best first).", ""]
    seeds = ', '.join(map(str, protocol['tune_seeds']))
    metric = ' / '.join(METRIC_WORDS[m] for m in protocol['metric'])
    if protocol.get('stop_at_val_loss'):
        metric = (f"the fewest iterations to val loss <= {protocol['stop_at_val_loss']:g} (where its runs stopped), "
                  f"among those that reached it on every tuning seed; else {metric}")
    where = f" at `{protocol['tuned_at']}` only" if protocol.get('tuned_at') else ""
    lines = [f"**Protocol: each variant at its own best settings.** For every variant, each candidate of "
             f"`tune = {protocol['tune']!r}` was trained{where} on tuning seed{'s' if len(protocol['tune_seeds']) > 1 else ''} "
             f"{seeds} (never used in the comparison); the candidate with {metric}, averaged over them, was chosen "
             f"(a candidate that diverged ranks last); the comparison below trains every variant at its own choice"
             + (f" (the one chosen at `{protocol['tuned_at']}`) at every point of the grid: at the other points it "
                "was not tuned, and may do better at other settings there." if where else "."),
             "", "## Tuning", ""]
    # every candidate any variant tried: tune's order when they all tried the same, else the order of the
    # values (a variant's own values, blank elsewhere)
    tried = {c['label']: c['candidate'] for t in tuning for c in t['candidates']}
    labels = list(tried)
    if any(len(t['candidates']) < len(labels) for t in tuning):
        labels.sort(key=lambda label: [(0, v, '') if isinstance(v, (int, float)) else (1, 0, str(v))
                                       for v in tried[label].values()])
    rows = []
    for t in tuning:
        cells = []
        own = {c['label']: c for c in t['candidates']}
        for c in (own.get(label) for label in labels):
            if c is None:
                cells.append('')
                continue
            cell = 'diverged' if c['diverged'] else (
                f"{c['accuracy']:.3f} (val {c['val_loss']:.4f})" if t['metric'] == 'accuracy' else f"{c['val_loss']:.4f}")
            if c.get('reached'):
                cell = f"at iter {c['iters']:.0f}: {cell}"
            elif c.get('outranked'):
                cell = f"out-ranked at iter {c['iters']:.0f}: {cell}"
            cells.append(f"**{cell}**" if c['chosen'] else cell)
        rows.append([f"`{t['variant']}`", *cells, t['chosen'] or 'none: every candidate diverged'])
    lines += table(['variant', *(f"`{label}`" for label in labels), 'chosen'], rows)
    lines += ["", "Each cell: the candidate's " + ("answer accuracy (and final val loss)" if 'accuracy' in protocol['metric']
              else "final val loss") + ", the mean over the tuning seeds; bold: chosen."
              + (" Blank: not one of that variant's candidates (each variant tried values around its own)."
                 if any(len(t['candidates']) < len(labels) for t in tuning) else '')
              + (f" \"at iter n\": every tuning seed stopped at stop_at_val_loss={protocol['stop_at_val_loss']:g}, at n "
                 "iterations on average; such a candidate ranks above every one that did not, the sooner the better. "
                 "\"out-ranked at iter n\": stopped there, not having reached it, once another candidate had reached it "
                 "in fewer iterations (it can only rank below that one)."
                 if protocol.get('stop_at_val_loss') else ''), ""]
    warnings = [f"- `{t['variant']}`: {w}" for t in tuning for w in t['warnings']]
    if warnings:
        lines += ["Chosen at the edge of the range tried (the best may lie outside it):", "", *warnings, ""]
    chosen = {t['chosen'] for t in tuning if t['chosen']}
    if len(chosen) > 1:
        lines += ["The variants' best settings differ: a config tuned for one variant is not tuned for another.", ""]
    return lines


def budget_words(max_iters):
    """'N iterations', or each grid point's max_iters where they differ. max_iters: {point label: max_iters}."""
    if len(set(max_iters.values())) == 1:
        return f"{next(iter(max_iters.values()))} iterations"
    return 'max_iters by grid point: ' + ', '.join(f'`{label}` {n}' for label, n in max_iters.items())


def stop_lines(results, target, max_iters):
    """How soon each run reached train.py's stop_at_val_loss (where it stopped), seed by seed."""
    lines = [f"## Iterations to val loss <= {target:g}", "",
             f"Every run ended at its first evaluation whose val loss was at or below stop_at_val_loss={target:g} "
             f"(an iteration below), or at the end of its budget ({budget_words(max_iters)}) without reaching it "
             "(\"not by\"). The final val losses above are then those of the stopping point.", ""]
    rows = []
    for variant in dict.fromkeys(r['variant'] for r in results):
        rs = [r for r in results if r['variant'] == variant]
        rows.append([f"`{variant}`", f"{sum(r['reached_target'] for r in rs)} of {len(rs)}",
                     ', '.join(f"{r['final_iter']}" if r['reached_target'] else f"not by {r['final_iter']}" for r in rs)])
    lines += table(['variant', 'reached', 'iteration, per seed'], rows) + [""]
    for variant in dict.fromkeys(r['variant'] for r in results if r['variant'] == r['base']):
        rs = [r for r in results if r['variant'] == variant]
        if not all(r['reached_target'] for r in rs):
            lines += [f"**`{variant}` did not reach it on every seed ({sum(r['reached_target'] for r in rs)} of "
                      f"{len(rs)})**: at this setting and budget a variant that does not reach it is not shown to do "
                      f"worse than base. Give every run more iterations, or choose an easier setting, until base "
                      f"reaches it on every seed.", ""]
    return lines


def data_words(results):
    """The recall parts as the runs' data names them (eval.py's part_words: a needle dataset's 'other needles' and
    'text'), and 'unit', what an example holds N of ('pairs', 'needles'); MQAR's where the runs do not all agree."""
    said = {tuple(sorted(r['part_words'].items())) if r.get('part_words') else None
            for r in results if 'filler_length' in r}
    words = dict(said.pop()) if len(said) == 1 and None not in said else dict(PART_WORDS['mqar'])
    return dict(words, unit=words['pairs'].removeprefix('other '))


def filler_lines(results):
    """{line label: runs} for attention.png: one line per attn_type across the grid points, whose datasets
    differ in filler length; where one attn_type has several points at the same filler length (a grid over
    widths, say), one line per variant (attn_type and point) instead, so that no point is averaged into
    another."""
    runs = [r for r in results if 'filler_length' in r]
    by_type = {}
    for r in runs:
        by_type.setdefault(r['attn_type'], []).append(r)
    mixed = any(len({r['point'] for r in rs if r['filler_length'] == f}) > 1
                for rs in by_type.values() for f in {r['filler_length'] for r in rs})
    if not mixed:
        return by_type
    by_variant = {}
    for r in runs:
        by_variant.setdefault(r['variant'], []).append(r)
    return by_variant


def ranked(summary, prefix):
    """The key a variant's lookup head (prefix '') or reading layer ('layer_') was ranked by: the signed value share,
    or, for runs read by an earlier eval.py without the value and key apart, the signed answer share."""
    key = f'{prefix}signed_value_share'
    return key if key in summary else f'{prefix}signed_answer_share'


def value_and_key(summary, prefix):
    """The 'value (signed) | key (signed)' cells, or '—' where the runs were read without them apart."""
    if f'{prefix}value_share' not in summary:
        return '— | —'
    return ' | '.join(f"{fmt(summary[f'{prefix}{part}_share'], 3)} ({fmt(summary[f'{prefix}signed_{part}_share'], 3)})"
                      for part in ('value', 'key'))


def share_table(shares, results, prefix, answer, chosen, key):
    """attention_lines' table of the parts' shares at each run's lookup head (prefix '') or reading layer
    ('layer_'): answer and chosen name the columns, key the run's field naming its head or layer."""
    parts, words = ('noise', 'pairs', 'own', 'queries', 'filler'), data_words(results)
    return table(
        ['variant', f"{words['filler']} tokens", answer, 'value (signed)', 'key (signed)', 'token after the value '
         '(signed)', 'signed value, per seed', f'{chosen} per seed', 'noise', *(words[part] for part in parts[1:]),
         'reading (signed value)', 'reading (noise)'],
        [[f"`{variant}`", f"{s['filler_length']['mean']:g}",
          f"{fmt(s[f'{prefix}answer_share'], 3)} ({fmt(s[f'{prefix}signed_answer_share'], 3)})",
          value_and_key(s, prefix), fmt(s[f'{prefix}after_share'], 3) if f'{prefix}after_share' in s else '—',
          per_seed(s[ranked(s, prefix)]),
          ', '.join(r[key] for r in results if r['variant'] == variant and key in r),
          *(fmt(s[f'{prefix}{part}_share'], 3) for part in parts),
          paired_reading(s, ranked(s, prefix)), paired_reading(s, f'{prefix}noise_share')]
         for variant, s in shares.items()])


def attention_lines(summary, results, plots, target=None):
    """The report's section on where attention goes (recall data), or [] without it. target: stop_at_val_loss."""
    shares = {a: s for a, s in summary.items() if 'signed_answer_share' in s}
    if not shares:
        return []
    w = data_words(results)
    lines = ["## Where attention goes: the answer against attention noise (recall)", "",
             "eval.py --attention_noise=True on each run's final checkpoint (docs/eval.md)"
             + (f", which for a run that reached val loss {target:g} is where it stopped, so every such model is read "
                f"at the same val loss (one that did not is read at max_iters: its accuracy says how far it got)"
                if target else "") + ": every answer's "
             f"effective attention row (the weights that multiply V), split into the answer (the queried key and "
             f"its value in the {w['unit']}), the {w['pairs']}, the query's own token (it holds the key being asked: "
             f"part of the lookup, not noise), the earlier queries and the {w['filler']}, as shares of the row's "
             f"absolute mass; noise = {w['pairs']} + earlier queries + {w['filler']}. The answer is read apart too: "
             "its value (what the "
             "lookup carries into the output) and its key (what the query is matched against), and the token after "
             "the value apart (signed): above the first layer it can hold the value, which a head of the layer below "
             "moved there, and a lookup can read it there, where the parts count it as another "
             f"{w['unit'].rstrip('s')} or {w['filler']}. A signed share is "
             "the part's signed weight over the same mass: negative where the row subtracts it. Each run is read at "
             "its lookup head, the layer and head with the highest mean signed value share over all validation "
             "answers (chosen among the variant's own heads: DIFF and DINT have half as many as base, so base's "
             "best-of-more choice favours it slightly); a run read by an earlier eval.py, without the value and "
             "key apart (—), was ranked by the signed answer share. Mean ± sample standard deviation over seeds. "
             "Reading: the signed value share (the answer's, where there is none) minus base's at the same point, "
             "seed by seed, as for the val loss, and likewise the noise share.", ""]
    lines += share_table(shares, results, '', 'answer share (signed)', 'lookup head', 'lookup_head')
    lines += ["", "The layer as a whole: a head's share cannot tell a lookup spread over several heads from attention "
              "on noise, so each layer is also read by the norm of what each key adds to its output (all heads, "
              "through the values and c_proj; heads that cancel on a key cancel in its share; the signed answer "
              "share: a part's additions along the layer's output; docs/eval.md). Each run is read at its "
              "reading layer, the layer with the highest mean signed value share (the answer's, for a run read "
              "without the value and key apart).", ""]
    layered = {v: s for v, s in shares.items() if 'layer_signed_answer_share' in s}
    lines += share_table(layered, results, 'layer_', 'layer answer share (signed)', 'reading layer', 'reading_layer')
    lines.append("")
    if 'attention' in plots:
        lines += [f"![answer accuracy, signed value shares and noise share against filler length]"
                  f"({plots['attention']})", ""]
    return lines


def write_report(report_dir, summary, results, failures, samples, plots, setup):
    grid = (f" At each grid point ({'; '.join(f'`{p}`' for p in setup['grid'])}) every variant is trained and "
            f"compared with base at the same point." if setup.get('grid') else '')
    differ = "attn_type, seed and each variant's tuned settings" if setup['protocol']['tuned'] else "attn_type and seed"
    lines = [
        "# Attention variants compared", "",
        f"Command: `{setup['command']}`  ",
        *protocol_lines(setup['protocol'], setup['tuning']),
        *(["## Comparison", ""] if setup['protocol']['tuned'] else []),
        f"Every run: `{setup['base_config']}`" + (f" with `{setup['overrides']}`" if setup['overrides'] else '')
        + f", {budget_words(setup['max_iters'])}; seeds {', '.join(map(str, setup['seeds']))}. Only {differ} "
          f"differ between runs.{grid} Val loss is train.py's evaluation (the same fixed batches for every "
          f"run{'; over the answers alone, eval_answers_only' if setup.get('eval_answers_only') else ''}); mean ± "
          f"sample standard deviation over seeds.", ""]
    rows = []
    for attn_type, s in summary.items():
        base_params = summary[s['base']]['params'] if s['base'] in summary else None
        delta = (f"{s['params'] - base_params:+,} ({(s['params'] - base_params) / base_params:+.2%})"
                 if base_params and attn_type != s['base'] else '')
        rows.append([f"`{attn_type}`", f"{s['params']:,}", delta, fmt(s['final_val_loss']),
                     per_seed(s['final_val_loss'], 4), fmt(s['best_val_loss']), fmt(s['tokens_per_s'], 0),
                     fmt(s['peak_memory_mib'], 0), fmt(s['train_time_s'], 1),
                     reading(s['paired_vs_base']) if 'paired_vs_base' in s else ''])
    lines += table(['variant', 'parameters', 'vs base', 'final val loss', 'per seed', 'best val loss', 'tokens/s',
                    'peak memory (MiB)', 'training time (s)', 'reading'], rows)
    lines += ["", "Tokens/s: the median over logged iterations. Peak memory: tensors on CUDA/Gaudi, the "
              "process's peak resident size on CPU. Reading: runs with the same seed share data order and "
              "evaluation batches, so each variant is compared with base seed by seed (its final val loss "
              "minus base's, over the seeds both finished; below). It is called lower or higher than base only "
              "when every seed's difference has the same sign; when the signs differ there is no consistent "
              "difference, whatever the mean; one seed has no spread to judge it against. Even with no real "
              "difference, n seeds agree in sign by chance with probability 1/2^(n-1) (1/2 for 2 seeds, 1/4 "
              "for 3): agreement over few seeds is weak evidence.", ""]
    if setup.get('stop_at_val_loss'):
        lines += stop_lines(results, setup['stop_at_val_loss'], setup['max_iters'])
    paired = {a: s['paired_vs_base'] for a, s in summary.items() if 'paired_vs_base' in s}
    if paired:
        lines += ["## Final val loss against base, seed by seed", "",
                  "d = final val loss of the variant minus that of base with the same seed; mean ± sample "
                  "standard deviation of d over the seeds both finished.", ""]
        lines += table(['attn_type', 'seeds', 'd per seed', 'mean ± std', 'same sign on every seed'],
                       [[f"`{attn_type}`", ', '.join(map(str, p['seeds'])),
                         ', '.join(f'{d:+.4f}' for d in p['differences']),
                         '' if p['mean'] is None else f"{p['mean']:+.4f}"
                         + (f" ± {p['std']:.4f}" if p['std'] is not None else ''),
                         'one seed' if len(p['seeds']) == 1 else 'yes' if p['same_sign'] else 'no']
                        for attn_type, p in paired.items()]) + [""]
    accuracy = {a: s for a, s in summary.items() if 'accuracy' in s}
    if accuracy:
        pairs, unit = list(next(iter(accuracy.values()))['accuracy_by_pairs']), data_words(results)['unit']
        lines += ["## Answer accuracy (recall)", "",
                  "eval.py --recall=True on each run's final checkpoint: the share of answers in every validation "
                  "example that the model's most likely next token gets right; overall and by the example's number "
                  f"of key-value {unit} (mean ± sample standard deviation over seeds). Reading: the accuracy minus "
                  "base's at the same point, seed by seed, as for the val loss.", ""]
        lines += table(['variant', 'accuracy', 'per seed', *(f"{p} {unit}" for p in pairs), 'reading'],
                       [[f"`{variant}`", fmt(s['accuracy'], 3), per_seed(s['accuracy']),
                         *(fmt(s['accuracy_by_pairs'][p], 3) if p in s['accuracy_by_pairs'] else '' for p in pairs),
                         paired_reading(s, 'accuracy')] for variant, s in accuracy.items()]) + [""]
        if 'accuracy' in plots:
            lines += [f"![answer accuracy against the number of key-value pairs]({plots['accuracy']})", ""]
    lines += attention_lines(summary, results, plots, setup.get('stop_at_val_loss'))
    lines += retrieval_lines(summary, results, plots)
    if setup.get('changes'):
        lines += ["## Settings changed during the sweep", "",
                  "These runs were continued (compare.py --continue_changed=True) with other settings than they "
                  "started with, from the iteration of their checkpoint then:", ""]
        lines += [f"- `{c['run'] if 'run' in c else c['attn_type'] + ' seed ' + str(c['seed'])}`, "
                  f"from iter {c['from_iter']}: " +
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
    write_atomically(os.path.join(report_dir, 'report.md'), lambda f: f.write('\n'.join(lines)), then=WRITE_AGAIN)
