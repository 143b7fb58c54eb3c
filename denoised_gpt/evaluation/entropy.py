"""
Attention entropy (the low-rank DINT plan: "measure the entropy of attention weight distribution,
compare with the original model").

For every layer, head and map the model's analysis path gives (GPT.attention_maps: 'attn', or
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

import torch


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
            for layer, maps in model.attention_maps(idx):
                for name, a in maps.items():
                    per_head = normalised_row_entropy(a).sum(dim=(0, 2)).cpu()  # (heads,)
                    layers = sums.setdefault(name, [None] * model.config.n_layer)
                    layers[layer] = per_head if layers[layer] is None else layers[layer] + per_head
        rows += idx.size(0) * (idx.size(1) - 1)
    return {name: [(s / rows).tolist() for s in layers] for name, layers in sums.items()}


def entropy_summary(entropy):
    """{map name: [mean over heads, per layer]} and the overall mean, for the console and JSON."""
    return {name: [sum(h) / len(h) for h in layers] for name, layers in entropy.items()}


def plot_entropy(results, path):
    """results: [(label, {map name: [[per head] per layer]})], one row of heatmaps per checkpoint and
    one column per map name; colours fixed to [0, 1] so rows and columns compare. Writes a PNG."""
    import matplotlib
    matplotlib.use('Agg')  # files only: no display needed
    import matplotlib.pyplot as plt

    names = []
    for _, entropy in results:
        names += [n for n in entropy if n not in names]
    fig, axes = plt.subplots(len(results), len(names), squeeze=False,
                             figsize=(3.2 * len(names) + 1, 2.8 * len(results) + 0.6), layout='constrained')
    image = None
    for r, (label, entropy) in enumerate(results):
        for c, name in enumerate(names):
            ax = axes[r][c]
            if name not in entropy:
                ax.axis('off')  # e.g. base has no branch maps: say so in the empty cell
                ax.text(0.5, 0.5, f"{label}\nhas no {name} map", ha='center', va='center', fontsize=8,
                        transform=ax.transAxes)
                continue
            image = ax.imshow(torch.tensor(entropy[name]).numpy(), vmin=0, vmax=1, cmap='viridis',
                              aspect='auto', interpolation='nearest')
            mean = sum(map(sum, entropy[name])) / sum(map(len, entropy[name]))
            ax.set_title(f"{label}\n{name} (mean {mean:.3f})", fontsize=8)
            n_layers, n_heads = len(entropy[name]), len(entropy[name][0])
            ax.set_xticks(range(n_heads))  # whole heads and layers, not fractional ticks
            ax.set_yticks(range(n_layers))
            ax.set_xlabel('head', fontsize=8)
            ax.set_ylabel('layer', fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label='normalised entropy H / log(keys)')
    fig.savefig(path, dpi=100)
    plt.close(fig)
