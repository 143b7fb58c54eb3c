"""Starting from a trained model (finetune.py, train.py's init_from=PATH / trainable / lora_* /
merge_lora): conversion of a base checkpoint (ours or nanoGPT's) to another attn_type, freezing,
peft LoRA adapters and their merge, and exact resume of frozen and LoRA runs."""
import copy
import shutil

import pytest
import torch

from denoised_gpt.checkpoint import read_checkpoint
from denoised_gpt.finetune import (apply_trainable, check_finetune_settings, merge_lora, merged_checkpoint,
                                   model_from_checkpoint, new_parameter_names, new_run_model_args)
from helpers import (TINY_MODEL, VOCAB, iter_losses, make_dataset, run_train, run_train_in_process,
                     save_model_checkpoint, tiny_gpt)
from model import ATTENTION_TYPES, GPT, GPTConfig
from nanogpt_reference import BETAS, LR, WD, NanoConfig, NanoGPT, nano_checkpoint, train_steps

F64 = torch.float64
SEED = 1337  # tests/config_tiny.py's run seed (train.py's default)
# what each variant adds to base's tensors, per layer (docs/attention.md); linear adds nothing
ADDED = {
    'dint_lowrank': {'attn.q2_down.weight', 'attn.q2_up.weight', 'attn.k2_down.weight', 'attn.k2_up.weight',
                     'attn.lambda_q1', 'attn.lambda_k1', 'attn.lambda_q2', 'attn.lambda_k2', 'attn.head_norm.weight'},
    'diff': {'attn.lambda_q1', 'attn.lambda_k1', 'attn.lambda_q2', 'attn.lambda_k2', 'attn.head_norm.weight'},
    'linear': set(),
}


def nanogpt_base_checkpoint(out_dir, mask_buffer=True):
    """out_dir/ckpt.pt as nanoGPT's train.py writes it (compiled-model key prefix, no rng entry, its
    causal-mask buffers), after two AdamW steps so that it is not just an init."""
    cfg = NanoConfig(**{**TINY_MODEL, 'dropout': 0.0})
    torch.manual_seed(0)
    nano = NanoGPT(cfg, mask_buffer=mask_buffer)
    optimizer = nano.configure_optimizers(WD, LR, BETAS)
    train_steps(nano, optimizer, cfg, seeds=[0, 1])
    ckpt = nano_checkpoint(nano, optimizer, cfg, compiled=True)
    assert 'rng' not in ckpt and all(k.startswith('_orig_mod.') for k in ckpt['model'])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, out_dir / 'ckpt.pt')
    return {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items() if not k.endswith('attn.bias')}


def converted(base_dir, attn_type, seed=SEED, **variant):
    """What train.py builds from init_from=base_dir: (model, listed new names)."""
    ckpt = read_checkpoint(base_dir)[1]
    run_args = {**TINY_MODEL, 'dropout': 0.0, 'attn_type': attn_type, **variant}
    torch.manual_seed(seed)
    return model_from_checkpoint(ckpt, new_run_model_args(ckpt['model_args'], run_args, given=set()))


# ---------------------------------------------------------------------------- conversion

@pytest.mark.parametrize('attn_type', sorted(ADDED))
def test_conversion_keeps_every_base_tensor_and_lists_only_the_new_ones(tmp_path, attn_type):
    base_sd = nanogpt_base_checkpoint(tmp_path / 'nano')
    model, listed = converted(tmp_path / 'nano', attn_type)
    own = model.state_dict()
    for name, tensor in base_sd.items():
        assert torch.equal(own[name], tensor), name
    expected_new = {f'transformer.h.{i}.{k}' for i in range(2) for k in ADDED[attn_type]}
    assert set(listed) == set(own) - set(base_sd) - {'lm_head.weight'} == expected_new
    assert set(new_parameter_names(model)) == expected_new  # the rule trainable='new' uses
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after the copy


def test_a_checkpoint_of_the_runs_own_attn_type_is_taken_as_it_is(tmp_path):
    """No conversion: the model is built empty and holds the checkpoint's tensors, bitwise, still tied."""
    trained = tiny_gpt('dint', seed=3)
    save_model_checkpoint(tmp_path / 'dint', trained)
    model, listed = model_from_checkpoint(read_checkpoint(tmp_path / 'dint')[1], {**TINY_MODEL, 'attn_type': 'dint'})
    assert listed == []
    own, theirs = model.state_dict(), trained.state_dict()
    assert own.keys() == theirs.keys() and all(torch.equal(own[k], theirs[k]) for k in own)
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_variant_that_does_not_fit_base_says_so(tmp_path):
    nanogpt_base_checkpoint(tmp_path / 'nano')
    fits = [a for a in ATTENTION_TYPES if a != 'base' and ATTENTION_TYPES[a].c_attn_projections == 3]
    assert {'diff', 'dint', 'dint_lowrank', 'linear'} <= set(fits)
    for attn_type in (a for a in ATTENTION_TYPES if ATTENTION_TYPES[a].c_attn_projections != 3):
        with pytest.raises(ValueError, match=rf"attn_type='{attn_type}' has no key projection .* Convert to one of "
                                             rf"{', '.join(fits)}, or train"):
            converted(tmp_path / 'nano', attn_type)


def test_a_checkpoint_of_another_variant_only_converts_from_base(tmp_path):
    diff = tiny_gpt('diff')
    save_model_checkpoint(tmp_path / 'diff', diff, model_args={**TINY_MODEL, 'attn_type': 'diff'}, iter_num=1,
                          best_val_loss=1.0)
    with pytest.raises(ValueError, match=r"attn_type is 'diff': only a 'base' checkpoint converts"):
        converted(tmp_path / 'diff', 'dint_lowrank')
    model, new = converted(tmp_path / 'diff', 'diff')  # its own attn_type loads as it is
    assert new == [] and all(torch.equal(v, diff.state_dict()[k]) for k, v in model.state_dict().items())


def test_the_checkpoints_shape_wins_and_a_different_given_one_is_an_error():
    saved = {**TINY_MODEL, 'dropout': 0.1}
    run = {**TINY_MODEL, 'n_layer': 4, 'block_size': 16, 'dropout': 0.0, 'attn_type': 'linear'}
    args = new_run_model_args(saved, run, given={'block_size', 'dropout', 'attn_type'})
    assert args == {**TINY_MODEL, 'dropout': 0.0, 'attn_type': 'linear'}  # train.py crops block_size after
    with pytest.raises(ValueError, match="n_layer: checkpoint 2, this run 4"):
        new_run_model_args(saved, run, given={'n_layer'})


# ---------------------------------------------------------------------------- LoRA

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_targets='c_attn,c_proj,c_fc')


def test_lora_starts_as_the_model_and_merges_to_the_same_logits_float64():
    base = tiny_gpt().to(F64)
    idx = torch.randint(0, VOCAB, (3, 32), generator=torch.Generator().manual_seed(1))
    base_logits = base(idx, targets=idx)[0]
    model = apply_trainable(copy.deepcopy(base), 'lora', **LORA)
    # 2 layers x (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) x (lora_A, lora_B); nothing else trains
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 16 and all('.lora_A.' in n or '.lora_B.' in n for n in trainable)
    assert torch.equal(model(idx, targets=idx)[0], base_logits)  # lora_B starts at zero: exactly the model

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):  # make the adapters non-zero
        model(idx, targets=idx)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    adapter_logits = model(idx, targets=idx)[0].detach()
    assert (adapter_logits - base_logits).abs().max() > 1e-3  # the adapters changed the model

    ckpt = {'model': model.state_dict(), 'model_args': {**TINY_MODEL, 'attn_type': 'base'},
            'config': {'trainable': 'lora', **LORA}, 'optimizer': {}, 'iter_num': 3, 'best_val_loss': 1.0}
    merged = merged_checkpoint(ckpt)
    assert set(merged['model']) == set(base.state_dict())  # plain names: what sample.py / eval.py load
    # no optimizer state, so init_from=resume starts AdamW fresh (the grown checkpoints' path, test_grow.py)
    # instead of failing to match the adapters' moments to merged weights
    assert merged['optimizer'] is None and merged['config']['trainable'] == 'all'
    plain = GPT(GPTConfig(**TINY_MODEL)).to(F64)
    plain.load_state_dict(merged['model'])
    merged_logits = plain(idx, targets=idx)[0].detach()
    assert ((merged_logits - adapter_logits).abs().max() / adapter_logits.abs().max()) < 1e-10


def test_lora_on_a_converted_model_also_trains_what_the_variant_adds():
    model = apply_trainable(tiny_gpt('dint_lowrank', lowrank_rank=4).to(F64), 'lora', **LORA)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    added = {f'transformer.h.{i}.{k}' for i in range(2) for k in ADDED['dint_lowrank']}
    assert added <= trainable and all('.lora_' in n for n in trainable - added)
    assert not any(p.requires_grad for n, p in model.named_parameters() if 'base_layer' in n)
    merge_lora(model)
    assert set(model.state_dict()) == set(tiny_gpt('dint_lowrank', lowrank_rank=4).to(F64).state_dict())


def test_what_cannot_train_is_refused():
    with pytest.raises(ValueError, match="trainable='new' leaves nothing to train: attn_type='linear' adds no"):
        apply_trainable(tiny_gpt('linear').to(F64), 'new')
    with pytest.raises(ValueError, match="lora_targets='c_nope': .*c_attn, c_proj, c_fc"):
        apply_trainable(tiny_gpt().to(F64), 'lora', **{**LORA, 'lora_targets': 'c_nope'})
    with pytest.raises(ValueError, match="lora_rank=0 must be at least 1"):
        check_finetune_settings('lora', 'gpt2', set(), **{**LORA, 'lora_rank': 0})
    with pytest.raises(ValueError, match="trainable='some' must be one of 'all', 'new', 'lora'"):
        check_finetune_settings('some', 'gpt2', set(), **LORA)
    with pytest.raises(ValueError, match="has no LoRA adapters to merge"):
        merged_checkpoint({'config': {'trainable': 'new'}, 'model': {}})
    lora_ckpt = {'model': apply_trainable(tiny_gpt().to(F64), 'lora', **LORA).state_dict(), 'model_args': TINY_MODEL}
    with pytest.raises(ValueError, match=r"holds LoRA adapters: merge them first .*--merge_lora=True"):
        model_from_checkpoint(lora_ckpt, {**TINY_MODEL, 'attn_type': 'base'})


# ---------------------------------------------------------------------------- train.py

def train(out_dir, data, *args, nproc=1, expect_rc=0):
    """train.py on the test config: DDP runs under torchrun, one-process runs in this process."""
    if nproc == 1:
        return run_train_in_process(out_dir, data, *args, expect_rc=expect_rc)
    return run_train(out_dir, data, *args, nproc=nproc, expect_rc=expect_rc)


def resume_from_previous_checkpoint(full_dir, part_dir, data, max_iters, nproc=1):
    """Resume a copy of full_dir's ckpt.prev.pt to max_iters: it must redo full_dir's last iterations
    exactly. Returns (the resumed run's output, the iteration it started from)."""
    part_dir.mkdir()
    shutil.copyfile(full_dir / 'ckpt.prev.pt', part_dir / 'ckpt.pt')
    resumed = train(part_dir, data, '--init_from=resume', f'--max_iters={max_iters}', nproc=nproc)  # config: 20
    return resumed, read_checkpoint(full_dir / 'ckpt.prev.pt')[1]['iter_num']


def assert_same_run(full, full_dir, resumed, part_dir, resumed_from, n):
    assert "trainable parameters" in resumed.stdout
    before, again = iter_losses(full.stdout), iter_losses(resumed.stdout)
    assert sorted(again) == list(range(resumed_from, n)) and len(set(before.values())) > n // 2
    assert all(again[it] == before[it] for it in again), (again, before)
    a, b = read_checkpoint(full_dir)[1]['model'], read_checkpoint(part_dir)[1]['model']
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_trainable_new_from_a_nanogpt_checkpoint_moves_only_the_new_tensors_and_resumes_exactly(tmp_path):
    """Under DDP (2 ranks, gloo): frozen parameters get no gradient hooks and no AdamW state."""
    data = make_dataset(tmp_path)
    base_sd = nanogpt_base_checkpoint(tmp_path / 'nano')
    at_init, new = converted(tmp_path / 'nano', 'dint_lowrank', lowrank_rank=4)  # train.py's seed: same init
    full = run_train(tmp_path / 'full', data, f'--init_from={tmp_path / "nano"}', '--attn_type=dint_lowrank',
                     '--lowrank_rank=4', '--trainable=new', '--max_iters=10', '--eval_interval=5', nproc=2)
    assert '2 process(es)' in full.stdout
    assert sorted(iter_losses(full.stdout)) == list(range(10))  # a new run: iteration 0 onwards
    total = sum(p.numel() for p in at_init.parameters())
    assert f"trainable parameters: {sum(at_init.get_parameter(n).numel() for n in new):,} of {total:,}" in full.stdout
    ckpt = read_checkpoint(tmp_path / 'full')[1]
    for name, tensor in base_sd.items():
        assert torch.equal(ckpt['model'][name], tensor), name
    for name in new:
        assert not torch.equal(ckpt['model'][name], at_init.state_dict()[name]), name
    assert sorted(sum(ckpt['optimizer_param_names'], [])) == sorted(new)  # AdamW holds only these

    resumed, since = resume_from_previous_checkpoint(tmp_path / 'full', tmp_path / 'part', data, 10, nproc=2)
    assert since == 5
    assert_same_run(full, tmp_path / 'full', resumed, tmp_path / 'part', since, 10)
    # what trains decides what the optimizer holds: a resume cannot change it
    proc = train(tmp_path / 'part', data, '--init_from=resume', '--trainable=all', expect_rc=2)
    assert "trainable: checkpoint 'new', this run 'all'" in proc.stderr and "--init_from=" in proc.stderr


def test_lora_run_resumes_exactly_and_merges_into_a_plain_checkpoint(tmp_path):
    data = make_dataset(tmp_path)
    nanogpt_base_checkpoint(tmp_path / 'nano')
    full = train(tmp_path / 'full', data, f'--init_from={tmp_path / "nano"}', '--attn_type=linear',
                 '--trainable=lora', '--lora_rank=4', '--lora_dropout=0.1', '--max_iters=10', '--eval_interval=5')
    assert f"python3 train.py --out_dir={tmp_path / 'full'} --merge_lora=True" in full.stdout  # not sample.py
    resumed, since = resume_from_previous_checkpoint(tmp_path / 'full', tmp_path / 'part', data, 10)
    assert_same_run(full, tmp_path / 'full', resumed, tmp_path / 'part', since, 10)

    merge = train(tmp_path / 'full', data, '--merge_lora=True')
    assert f"into {tmp_path / 'full' / 'merged' / 'ckpt.pt'}" in merge.stdout
    lora_ckpt, merged = read_checkpoint(tmp_path / 'full')[1], read_checkpoint(tmp_path / 'full' / 'merged')[1]
    # the adapter model, rebuilt the way a resume does, against the merged checkpoint read the way sample.py does
    adapter = apply_trainable(GPT(GPTConfig(**lora_ckpt['model_args'])), 'lora', lora_rank=4, lora_alpha=16.0,
                              lora_dropout=0.1, lora_targets='c_attn,c_proj,c_fc').eval()
    adapter.load_state_dict(lora_ckpt['model'])
    plain = GPT(GPTConfig(**merged['model_args'])).eval()
    plain.load_state_dict(merged['model'])
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    a, b = adapter(idx, targets=idx)[0], plain(idx, targets=idx)[0]
    assert (a - b).abs().max() < 1e-5 * a.abs().max()  # float32 checkpoint: merged in float32
    b_weights = [v for k, v in lora_ckpt['model'].items() if '.lora_B.' in k]
    assert len(b_weights) == 8 and all(w.abs().max() > 0 for w in b_weights)  # the adapters did train


@pytest.mark.parametrize('args, message', [
    (['--trainable=new'], "trainable='new' freezes trained weights, but init_from='scratch' has none"),
    (['--init_from=gpt2', '--lora_rank=4'], "lora_rank only apply with trainable='lora'"),
    (['--init_from=OUT', '--attn_type=linear'], "is in out_dir="),
])
def test_bad_finetune_settings_fail_in_one_line(tmp_path, args, message):
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'ckpt.pt').write_bytes(b'a checkpoint')
    data = tmp_path / 'empty-data'  # token files that are there (train.py looks for them before the settings)
    data.mkdir()
    for split in ('train', 'val'):
        (data / f'{split}.bin').touch()
    proc = train(out, data, *[a.replace('OUT', str(out)) for a in args], expect_rc=2)
    assert proc.stderr.startswith("train.py: error: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / 'ckpt.pt').read_bytes() == b'a checkpoint'  # nothing already written is lost
