"""
Attention entropy (the low-rank DINT plan: "measure the entropy of attention weight distribution,
compare with the original model").

For every layer, head and map the model's analysis path gives (each attention layer's attention_maps: 'attn', or
'branch1', 'branch2' and 'combined' for diff / dint / dint_lowrank), each query row i sees i + 1 keys.
Its Shannon entropy H_i = -sum_j p_ij log p_ij is divided by its largest possible value log(i + 1),
so a uniform row scores 1 and a one-hot row 0 whatever its position. Row 0 (one visible key, log 1 = 0)
is left out. The figure is the mean of H_i / log(i + 1) over rows 1..T-1 and over all sequences.

Signed maps: DIFF's A1 - lambda A2 and DINT's A1 + lambda (A3 - A2) have negative entries and rows that
need not sum to 1, so they are not distributions. Their entropy is taken of p_ij = |a_ij| / sum_j |a_ij|,
the distribution of attention *magnitude* over keys: 1 when every key gets the same absolute weight,
0 when all of it sits on one key. For a map with no negative entries (softmax branches, linear
attention) this is the ordinary entropy of the row.
"""

import os
from dataclasses import dataclass

import torch

from denoised_gpt.evaluation import attention_inputs


def normalised_row_entropy(maps):
    """(..., T, T) causal maps -> (..., T - 1): H_i / log(i + 1) for query rows i = 1..T-1."""
    p = maps.double().abs()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    h = -torch.special.xlogy(p, p).sum(-1)  # xlogy: 0 log 0 = 0 for the masked future keys
    T = maps.size(-1)
    visible = torch.arange(1, T + 1, dtype=torch.float64, device=maps.device)
    return (h / visible.log())[..., 1:]


@torch.no_grad()
def attention_entropy(model, batches, ctx):
    """Mean normalised entropy per layer and head over the token batches (iterable of (B, T) ids).
    Returns {map name: [[head 0, head 1, ...] for each layer]}."""
    sums, rows = {}, 0
    for idx in batches:
        with ctx:
            for layer, attn, x in attention_inputs(model, idx):
                for name, a in attn.attention_maps(x).items():
                    per_head = normalised_row_entropy(a).sum(dim=(0, 2)).cpu()  # (heads,)
                    layers = sums.setdefault(name, [None] * model.config.n_layer)
                    layers[layer] = per_head if layers[layer] is None else layers[layer] + per_head
        rows += idx.size(0) * (idx.size(1) - 1)
    return {name: [(s / rows).tolist() for s in layers] for name, layers in sums.items()}


def entropy_summary(entropy):
    """{map name: [mean over heads, per layer]}, for the console and JSON."""
    return {name: [sum(h) / len(h) for h in layers] for name, layers in entropy.items()}


def plot_entropy(results, path=None):
    """plot_heatmaps of attention entropies (results: [(run name, {map name: [[per head] per layer]})])."""
    return plot_heatmaps(results, 'normalised entropy H / log(keys)', path)


PER_ROW = 3  # heatmaps side by side in plot_heatmaps' figure


@dataclass
class Panel:
    """A plot_heatmaps panel with more than its values: signed (coloured from -1 to 1 on a scale of its own,
    as signed shares are) and a cell (layer, head) or a whole layer (an int) boxed, e.g. the one a ranking chose."""
    values: object  # [[per head] per layer], or {column name: [per layer]}
    signed: bool = False
    mark: object = None


def plot_heatmaps(results, colour_label, path=None):
    """results: [(run name, {panel name: [[per head] per layer]})] with values in [0, 1] -> a matplotlib
    Figure of heatmaps (layers x heads) in rows of PER_ROW, one per panel that exists, the colour bar below; a
    panel given as {column name: [per layer]} has those named columns instead of heads (and no mean: its columns
    are different quantities). The first run's panels
    in their order, then the next run's, so that dint compared with base reads branch1, branch2,
    combined, attn, the combined map next to the one it replaces. Each panel is titled with its run and
    name; colours are fixed to [0, 1] so that panels compare. Writes a PNG to path when given. The figure
    is returned for inspection (fig.axes: the panels in that order, then the colour bar)."""
    from matplotlib.figure import Figure  # no pyplot: no backend to choose, no global figure to close

    from matplotlib.patches import Rectangle

    panels = [(label, name, p if isinstance(p, Panel) else Panel(p))
              for label, maps in results for name, p in maps.items()]
    if not panels:
        raise ValueError("plot_heatmaps: nothing to plot")
    # at most PER_ROW panels a row, so that the PNG reads at a page's width (~1000 px) with fonts of 10 points
    columns_n = min(PER_ROW, len(panels))
    rows_n = -(-len(panels) // columns_n)
    fig = Figure(figsize=(3.3 * columns_n + 0.4, 3.1 * rows_n + 0.9), layout='constrained')
    grid = fig.subplots(rows_n, columns_n, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(panels):]:  # the last row's empty places
        fig.delaxes(ax)
    axes = axes[:len(panels)]
    images = {}  # the last image of each colour scale, for its bar
    for ax, (label, name, panel) in zip(axes, panels):
        layers = panel.values
        columns = list(layers) if isinstance(layers, dict) else None
        if columns:
            layers = [list(row) for row in zip(*layers.values())]
        images[panel.signed] = ax.imshow(torch.tensor(layers).numpy(), vmin=-1 if panel.signed else 0, vmax=1,
                                         cmap='RdBu_r' if panel.signed else 'viridis', aspect='auto',
                                         interpolation='nearest')
        if panel.mark is not None:  # a box around the cell, or around the whole layer's row
            layer, head = (panel.mark, None) if isinstance(panel.mark, int) else panel.mark
            x, width = (-0.5, len(layers[0])) if head is None else (head - 0.5, 1)
            ax.add_patch(Rectangle((x, layer - 0.5), width, 1, fill=False, edgecolor='red', linewidth=2))
        if columns:
            ax.set_title(f"{label}\n{name}", fontsize=10)
            # upright: names of several words side by side would run into each other
            ax.set_xticks(range(len(columns)), columns, fontsize=9, rotation=90, ha='right', va='center',
                          rotation_mode='anchor')
            ax.set_xlabel('part (all heads together)', fontsize=10)
        else:
            mean = sum(map(sum, layers)) / sum(map(len, layers))
            ax.set_title(f"{label}\n{name} (mean {mean:.3f})", fontsize=10)
            ax.set_xticks(range(len(layers[0])))  # whole heads and layers, not fractional ticks
            ax.set_xlabel('head', fontsize=10)
        ax.set_yticks(range(len(layers)))
        ax.set_ylabel('layer', fontsize=10)
        ax.tick_params(labelsize=9)
    for signed, image in images.items():
        bar = fig.colorbar(image, ax=axes, location='bottom', shrink=0.7, aspect=40)
        bar.set_label("signed share, -1 to 1 (negative where the row subtracts)" if signed else colour_label,
                      fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def run_name(out_dir):
    """How eval.py names a run (figure titles, entropy_<name>.json): out_dir's last part, or its last
    two when the last one is a name that many runs' directories share, e.g. 'out-x/merged' (where
    train.py --merge_lora writes a LoRA run's merged model) rather than 'merged', or
    'out-x/ckpt.prev.pt' for a checkpoint file. May hold a '/': see file_name_part."""
    from denoised_gpt.finetune import MERGED_DIR
    parent, last = os.path.split(os.path.abspath(out_dir))  # abspath: '.' and '..' become real names
    if last in (MERGED_DIR, 'out') or last.endswith('.pt'):  # 'out': nanoGPT's default out_dir
        above = os.path.basename(parent)
        if above:
            return f"{above}/{last}"
    return last


def file_name_part(name):
    """A run name as part of a file name: path separators become '_' ('out-x/merged' -> 'out-x_merged')."""
    return name.replace('/', '_').replace(os.sep, '_')
