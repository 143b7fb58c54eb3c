"""nanoGPT interoperability, both ways, against an independent nanoGPT-shaped model written here:
its checkpoints resume in our GPT (weights and AdamW state, by parameter name), and a `base`
checkpoint of ours loads and resumes in it the way nanoGPT's sample.py / train.py load one."""
import pytest
import torch

from denoised_gpt.checkpoint import (NANOGPT_MODEL_ARGS, load_optimizer_state, optimizer_param_names, read_checkpoint,
                                     save_checkpoint)
from helpers import ITER_LINE, VOCAB, make_dataset, run_script_in_process
from model import ATTENTION_TYPES, GPT, GPTConfig
from nanogpt_reference import BETAS, LR, WD, NanoConfig, NanoGPT, nano_checkpoint, train_steps

# ---------------------------------------------------------------------------- helpers

def adam_state_by_name(model, optimizer):
    return {n: optimizer.state[p] for n, p in model.named_parameters() if p in optimizer.state}


def our_base_config(cfg, **extra):
    return GPTConfig(**{k: getattr(cfg, k) for k in NANOGPT_MODEL_ARGS}, **extra)


# ---------------------------------------------------------------------------- parameter order

def nanogpt_parameter_names(n_layer, bias):
    names = ['transformer.wte.weight', 'transformer.wpe.weight']
    for i in range(n_layer):
        for mod in ('ln_1', 'attn.c_attn', 'attn.c_proj', 'ln_2', 'mlp.c_fc', 'mlp.c_proj'):
            names += [f'transformer.h.{i}.{mod}.weight'] + ([f'transformer.h.{i}.{mod}.bias'] if bias else [])
    return names + ['transformer.ln_f.weight'] + (['transformer.ln_f.bias'] if bias else [])


@pytest.mark.parametrize('bias', [True, False])
def test_base_parameters_come_in_nanogpt_order_with_nanogpt_init(bias):
    cfg = NanoConfig(bias=bias)
    torch.manual_seed(0)
    ours = GPT(our_base_config(cfg))
    torch.manual_seed(0)
    theirs = NanoGPT(cfg)
    assert [n for n, _ in ours.named_parameters()] == nanogpt_parameter_names(cfg.n_layer, bias)
    assert [n for n, _ in theirs.named_parameters()] == nanogpt_parameter_names(cfg.n_layer, bias)
    # the modules draw their initial weights in the same order too, so the same seed gives the same model
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize('attn_type', list(ATTENTION_TYPES))
def test_every_variant_registers_c_attn_right_before_c_proj(attn_type):
    n_head = 4
    model = GPT(GPTConfig(attn_type=attn_type, n_layer=2, n_head=n_head, n_embd=32, block_size=16, vocab_size=61))
    names = [n for n, _ in model.named_parameters()]
    for i in range(2):
        at = names.index(f'transformer.h.{i}.attn.c_attn.weight')
        assert names[at:at + 4] == [f'transformer.h.{i}.attn.{m}' for m in
                                    ('c_attn.weight', 'c_attn.bias', 'c_proj.weight', 'c_proj.bias')]


# ---------------------------------------------------------------------------- nanoGPT -> ours

@pytest.mark.parametrize('compiled,mask_buffer', [(False, False), (True, True)])
def test_nanogpt_checkpoint_resumes_in_our_gpt_with_its_adamw_state(tmp_path, compiled, mask_buffer):
    cfg = NanoConfig()
    torch.manual_seed(1)
    nano = NanoGPT(cfg, mask_buffer=mask_buffer)
    nano_opt = nano.configure_optimizers(WD, LR, BETAS)
    train_steps(nano, nano_opt, cfg, seeds=[1, 2])
    torch.save(nano_checkpoint(nano, nano_opt, cfg, compiled), tmp_path / 'ckpt.pt')

    ckpt = read_checkpoint(tmp_path)[1]
    assert ckpt['model_args'] == {k: getattr(cfg, k) for k in NANOGPT_MODEL_ARGS}
    ours = GPT(GPTConfig(**ckpt['model_args']))
    ours.load_state_dict(ckpt['model'])  # no '_orig_mod.' prefixes, no causal-mask buffers left
    our_opt = ours.configure_optimizers(WD, LR, BETAS, 'cpu')
    load_optimizer_state(our_opt, ours, ckpt)

    theirs_by_name, ours_by_name = adam_state_by_name(nano, nano_opt), adam_state_by_name(ours, our_opt)
    assert sorted(ours_by_name) == sorted(theirs_by_name) == sorted(n for n, _ in ours.named_parameters())
    for name, state in theirs_by_name.items():
        for key in ('exp_avg', 'exp_avg_sq', 'step'):
            assert torch.equal(ours_by_name[name][key], state[key]), (name, key)
    assert [g['lr'] for g in our_opt.param_groups] == [LR, LR]
    assert [g['weight_decay'] for g in our_opt.param_groups] == [WD, 0.0]

    train_steps(nano, nano_opt, cfg, seeds=[3])
    train_steps(ours, our_opt, cfg, seeds=[3])
    theirs = dict(nano.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------- ours -> nanoGPT

def test_our_base_checkpoint_loads_and_resumes_in_nanogpt(tmp_path):
    cfg = NanoConfig(bias=False)
    torch.manual_seed(2)
    ours = GPT(our_base_config(cfg))
    our_opt = ours.configure_optimizers(WD, LR, BETAS, 'cpu')
    train_steps(ours, our_opt, cfg, seeds=[1, 2])
    model_args = {k: getattr(ours.config, k) for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias',
                                                       'vocab_size', 'dropout', 'attn_type', 'noise_init_std',
                                                       'lowrank_rank', 'linear_chunk_size')}
    save_checkpoint({'model': ours.state_dict(), 'optimizer': our_opt.state_dict(),
                     'optimizer_param_names': optimizer_param_names(ours, our_opt), 'model_args': model_args,
                     'iter_num': 2, 'best_val_loss': 3.5, 'config': {'dataset': 'shakespeare_char'}}, tmp_path)

    # what nanoGPT's sample.py and train.py (init_from='resume') do with it
    checkpoint = torch.load(tmp_path / 'ckpt.pt', map_location='cpu', weights_only=True)
    nano = NanoGPT(NanoConfig(**checkpoint['model_args']))  # a TypeError if a variant key were left in
    nano.load_state_dict(checkpoint['model'])
    nano_opt = nano.configure_optimizers(WD, LR, BETAS)
    nano_opt.load_state_dict(checkpoint['optimizer'])  # by position: needs nanoGPT's parameter order

    ours_by_name, theirs_by_name = adam_state_by_name(ours, our_opt), adam_state_by_name(nano, nano_opt)
    for name, state in ours_by_name.items():
        assert torch.equal(theirs_by_name[name]['exp_avg'], state['exp_avg']), name
        assert torch.equal(theirs_by_name[name]['exp_avg_sq'], state['exp_avg_sq']), name
    train_steps(ours, our_opt, cfg, seeds=[3])
    train_steps(nano, nano_opt, cfg, seeds=[3])
    theirs = dict(nano.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    # and our loader gives back the full model_args
    assert read_checkpoint(tmp_path)[1]['model_args'] == model_args


def test_nanogpt_refuses_a_non_base_checkpoint_by_name(tmp_path):
    # linear attention has base's exact parameter names and shapes: nanoGPT would load its weights
    # into softmax attention without a word, so its model_args keep attn_type for nanoGPT to refuse
    model = GPT(GPTConfig(attn_type='linear', n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=61))
    assert sorted(model.state_dict()) == sorted(NanoGPT(NanoConfig(n_layer=1)).state_dict())
    model_args = {k: getattr(model.config, k) for k in NANOGPT_MODEL_ARGS + ('attn_type', 'linear_chunk_size')}
    save_checkpoint({'model': model.state_dict(), 'optimizer': {}, 'model_args': model_args, 'iter_num': 0,
                     'best_val_loss': 9.0, 'config': {}}, tmp_path)
    checkpoint = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    with pytest.raises(TypeError, match="attn_type"):
        NanoConfig(**checkpoint['model_args'])
    assert read_checkpoint(tmp_path)[1]['model_args'] == model_args


def test_train_py_resumes_a_nanogpt_checkpoint_and_keeps_it(tmp_path):
    """The whole path of `python3 train.py --init_from=resume` on a ckpt.pt written the way nanoGPT's
    train.py writes it (its config dict too: device, dtype and compile of the machine it ran on, which
    are not taken over). It used to crash at the first step after moving the original to ckpt.prev.pt."""
    data = make_dataset(tmp_path)
    cfg = NanoConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)
    torch.manual_seed(0)
    model = NanoGPT(cfg)
    optimizer = model.configure_optimizers(WD, LR, BETAS)
    train_steps(model, optimizer, cfg, seeds=[0, 1])
    ckpt = nano_checkpoint(model, optimizer, cfg, compiled=True)
    ckpt['config'] = dict(out_dir='out-shakespeare-char', eval_interval=100, log_interval=1, eval_iters=4,
                          eval_only=False, always_save_checkpoint=True, init_from='scratch', wandb_log=False,
                          dataset=str(data), gradient_accumulation_steps=1, batch_size=4, block_size=32,
                          n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False, learning_rate=LR,
                          max_iters=2, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], grad_clip=1.0,
                          decay_lr=False, warmup_iters=0, lr_decay_iters=2, min_lr=1e-3, backend='nccl',
                          device='cuda', dtype='bfloat16', compile=True)
    out = tmp_path / 'nano'
    out.mkdir()
    torch.save(ckpt, out / 'ckpt.pt')
    original = (out / 'ckpt.pt').read_bytes()
    proc = run_script_in_process('train.py', ['--init_from=resume', f'--out_dir={out}', '--max_iters=5', '--device=cpu',
                                              '--dtype=float32'])  # nanoGPT's way: no config file
    assert proc.returncode == 0, proc.stderr
    assert sorted(int(m[1]) for m in ITER_LINE.finditer(proc.stdout)) == [2, 3, 4]
    assert "tokens per iteration will be: 128" in proc.stdout  # the nanoGPT run's batch x block
    resumed = read_checkpoint(out)[1]
    assert resumed['iter_num'] == 5 and resumed['config']['learning_rate'] == LR
    assert (out / 'ckpt.prev.pt').read_bytes() == original  # kept until a newer one existed
    # the AdamW state went on with the nanoGPT run's: step counts continue from 2
    assert all(s['step'].item() == 5 for s in resumed['optimizer']['state'].values())
