"""A minimal nanoGPT, written here independently of model.py: nanoGPT's GPTConfig (NanoConfig), its
model with nanoGPT's module names, parameter order and initialisation (NanoGPT), its AdamW grouping,
and the checkpoint its train.py saves (nano_checkpoint). test_nanogpt_compat.py and test_finetune.py
check our checkpoints against it, both ways. A plain module, not a test file."""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

# ---------------------------------------------------------------------------- nanoGPT's model, minimal


@dataclass
class NanoConfig:  # nanoGPT's GPTConfig: these seven fields and no others
    block_size: int = 16
    vocab_size: int = 61
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class NanoLayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoAttention(nn.Module):
    def __init__(self, cfg, mask_buffer):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        if mask_buffer:  # nanoGPT without flash attention keeps its causal mask as a buffer 'bias'
            # (only its presence in the checkpoint matters here: forward uses SDPA either way, so
            # both models compute the same numbers)
            self.register_buffer("bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size))
                                 .view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, cfg, mask_buffer):
        super().__init__()
        self.ln_1 = NanoLayerNorm(cfg.n_embd, cfg.bias)
        self.attn = NanoAttention(cfg, mask_buffer)
        self.ln_2 = NanoLayerNorm(cfg.n_embd, cfg.bias)
        self.mlp = NanoMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, cfg, mask_buffer=False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([NanoBlock(cfg, mask_buffer) for _ in range(cfg.n_layer)]),
            ln_f=NanoLayerNorm(cfg.n_embd, cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1))
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# ---------------------------------------------------------------------------- nanoGPT's training, minimal

LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def batch(seed, cfg):
    """A seeded batch of 4 random sequences: (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def train_steps(model, optimizer, cfg, seeds):
    """One AdamW step on batch(seed, cfg) per seed: works for NanoGPT and our GPT alike."""
    for s in seeds:
        _, loss = model(*batch(s, cfg))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def nano_checkpoint(model, optimizer, cfg, compiled):
    """What nanoGPT's train.py saves; a torch.compile'd model's state_dict names every key
    '_orig_mod.<name>' (compile stays off in CPU tests, so the prefix is added here)."""
    sd = model.state_dict()
    if compiled:
        sd = {'_orig_mod.' + k: v for k, v in sd.items()}
    model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                      bias=cfg.bias, vocab_size=cfg.vocab_size, dropout=cfg.dropout)
    return {'model': sd, 'optimizer': optimizer.state_dict(), 'model_args': model_args, 'iter_num': 2,
            'best_val_loss': 3.5, 'config': {'dataset': 'shakespeare_char', 'learning_rate': LR}}
