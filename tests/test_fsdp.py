"""parallel='fsdp' (FSDP2, denoised_gpt/parallel.py) on CPU with gloo: train.py under torchrun trains the
same model as DDP and as one process (and DDP the same as one process: the suite's DDP check, on these
runs rather than on another pair of the same runs), writes sharded checkpoints and resumes from them
exactly after a kill -9, on two ranks or in one process; convert_checkpoint.py consolidates them into a
ckpt.pt; every attn_type's sharded step equals the unsharded one and its sharded checkpoint reads back as
the gathered weights (tests/fsdp_steps.py, one launch for all); settings it cannot train with are
refused before out_dir is touched."""
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from denoised_gpt.checkpoint import read_checkpoint
from denoised_gpt.weights import model_with_weights
from helpers import (ITER_LINE, ROOT, TINY, VOCAB, eval_losses, iter_losses, logged_losses, make_dataset,
                     run_script_in_process, run_train, run_train_in_process, subprocess_env, tiny_checkpoint,
                     train_command)
from model import ATTENTION_TYPES, GPTConfig, NoiseFormerAttention
from nanogpt_reference import NanoConfig, NanoGPT

pytestmark = pytest.mark.slow  # torchrun runs of train.py (conftest.py: slow)


# FSDP2 on the CPU waits on CPU stream events, which torch 2.6 lacks: train.py refuses it there (the last test)
CPU_STREAM_EVENTS = hasattr(torch.cpu.Stream, 'record_event')
needs_cpu_fsdp = pytest.mark.skipif(not CPU_STREAM_EVENTS, reason=f"FSDP2 on the CPU needs CPU stream events, which "
                                                                  f"torch {torch.__version__} lacks")

CHARS = ''.join(chr(ord('a') + i % 26) if i < 26 else chr(ord('A') + i - 26) for i in range(VOCAB))


def descendants(pid):
    """The processes below `pid` (from /proc: Linux)."""
    children = {}
    for stat in Path('/proc').glob('[0-9]*/stat'):
        try:
            fields = stat.read_text().rsplit(')', 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def weights_differ(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_ddp_matches_one_process(one, ddp, tmp_path):
    """DDP (gloo, 2 ranks) trains what one process does with the same total accumulation (losses and
    weights to float32 rounding); only rank 0 saves."""
    assert '1 process(es)' in one.stdout and '2 process(es)' in ddp.stdout
    l1, l2 = iter_losses(one.stdout), iter_losses(ddp.stdout)
    assert sorted(l1) == sorted(l2) == list(range(8))
    for it in l1:
        assert abs(l1[it] - l2[it]) < 1e-5, (it, l1[it], l2[it])
    e1, e2 = eval_losses(one.stdout), eval_losses(ddp.stdout)
    assert sorted(e1) == sorted(e2) == [0, 4, 8]
    for it in e1:
        assert abs(e1[it] - e2[it]) < 1e-5
    # only rank 0 saves (twice: at the evaluations of iters 4 and 8); the results agree
    assert one.stdout.count('saved checkpoint') == ddp.stdout.count('saved checkpoint') == 2
    assert sorted(os.listdir(tmp_path / 'ddp')) == ['.lock', 'ckpt.prev.pt', 'ckpt.pt', 'metrics.jsonl']  # rank 0's
    w1, w2 = read_checkpoint(tmp_path / 'one')[1]['model'], read_checkpoint(tmp_path / 'ddp')[1]['model']
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=0, atol=1e-5)


@needs_cpu_fsdp
def test_fsdp_matches_ddp_and_one_process_and_resumes_after_kill_9_on_two_ranks_or_one(tmp_path):
    data = make_dataset(tmp_path)
    with open(data / 'meta.pkl', 'wb') as f:  # the characters, for sample.py
        pickle.dump({'vocab_size': VOCAB, 'itos': dict(enumerate(CHARS)), 'stoi': {c: i for i, c in enumerate(CHARS)}}, f)
    args = ['--attn_type=noiseformer_v2', '--gradient_accumulation_steps=4', '--eval_interval=4', '--eval_iters=5',
            '--lr_decay_iters=8']  # 5 eval batches: 3 + 2 per rank
    one = run_train_in_process(tmp_path / 'one', data, *args, '--max_iters=8')
    ddp = run_train(tmp_path / 'ddp', data, *args, '--max_iters=8', nproc=2)
    assert_ddp_matches_one_process(one, ddp, tmp_path)
    fsdp = run_train(tmp_path / 'fsdp', data, *args, '--max_iters=8', '--parallel=fsdp', nproc=2)
    assert 'FSDP2: weights, gradients and AdamW state sharded over 2 ranks' in fsdp.stdout
    l1, ld, lf = (logged_losses(tmp_path / name) for name in ('one', 'ddp', 'fsdp'))
    assert sorted(lf) == list(range(8)) and iter_losses(fsdp.stdout)[7] == round(lf[7], 6)
    # not bitwise: the grad norm sums per-shard norms, and the KL gradient joins the reduced one in another
    # order (measured: weights 2e-9 from DDP's, 1.2e-7 from one process's). A loss is a float32 mean of four
    # micro-batch means, summed over the ranks in another order: its last bits may differ (measured: at most
    # one unit in the last place, ulp), and weights 1e-7 apart move it by less. 8 ulp of the loss bounds both.
    for it in l1:
        ulp = torch.finfo(torch.float32).eps * abs(l1[it])
        assert abs(lf[it] - l1[it]) <= 8 * ulp and abs(lf[it] - ld[it]) <= 8 * ulp, (it, l1[it], ld[it], lf[it])
    e1, ef = eval_losses(one.stdout), eval_losses(fsdp.stdout)
    assert sorted(ef) == [0, 4, 8] and all(abs(ef[it] - e1[it]) <= 1e-4 for it in e1)  # printed to 4 decimals
    # each rank wrote its own shards; the newest and the one before are kept
    fsdp_dir = tmp_path / 'fsdp'
    assert sorted(p.name for p in fsdp_dir.iterdir()) == ['.lock', 'ckpt.sharded', 'ckpt.sharded-0000004',
                                                         'ckpt.sharded-0000008', 'metrics.jsonl']
    assert sorted(p.name for p in (fsdp_dir / 'ckpt.sharded-0000008').iterdir()) == [
        'checkpoint.json', 'rank-00000.safetensors', 'rank-00001.safetensors']
    assert f"checkpoint: {fsdp_dir / 'ckpt.sharded-0000008'} (best val loss" in fsdp.stdout
    ck1, ckd, ckf = (read_checkpoint(tmp_path / name)[1] for name in ('one', 'ddp', 'fsdp'))  # ckf: shards read whole
    assert ckf['model']['lm_head.weight'] is ckf['model']['transformer.wte.weight']
    assert list(ckf['model']) == list(ckd['model']) and ckf['optimizer_param_names'] == ckd['optimizer_param_names']
    assert weights_differ(ckf['model'], ckd['model']) < 1e-7 and weights_differ(ckf['model'], ck1['model']) < 1e-6
    for slot, state in ckd['optimizer']['state'].items():
        for key, value in state.items():
            assert ckf['optimizer']['state'][slot][key].shape == value.shape
            torch.testing.assert_close(ckf['optimizer']['state'][slot][key], value, rtol=0, atol=1e-7)
    # noise_mu moves through the KL term alone (sharded_kl): it moved, and as in one process (above)
    ck4 = read_checkpoint(fsdp_dir / 'ckpt.sharded-0000004')[1]
    assert ck4['iter_num'] == 4
    mu = [k for k in ckf['model'] if k.endswith('noise_mu')]
    assert mu and min((ckf['model'][k] - ck4['model'][k]).abs().max().item() for k in mu) > 1e-3

    # kill -9 of every process of the run (as when its node dies) after the iter-4 checkpoint, then resume
    killed = tmp_path / 'killed'
    proc = subprocess.Popen(train_command(killed, data, *args, '--max_iters=1000000', '--parallel=fsdp', nproc=2),
                            cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    for line in proc.stdout:
        m = ITER_LINE.match(line)
        if m and int(m[1]) >= 5:
            for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun starts its workers in sessions of their own
                os.kill(pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert read_checkpoint(killed)[1]['iter_num'] == 4
    (tmp_path / 'one_rank').mkdir()  # a copy of it, for the one-process resume below
    shutil.copytree(killed / 'ckpt.sharded-0000004', tmp_path / 'one_rank' / 'ckpt.sharded-0000004')
    shutil.copy(killed / 'ckpt.sharded', tmp_path / 'one_rank')
    resumed = run_train(killed, data, *args, '--max_iters=8', '--parallel=fsdp', '--init_from=resume', nproc=2)
    assert sorted(iter_losses(resumed.stdout)) == [4, 5, 6, 7]
    assert logged_losses(killed) == lf  # iterations 0-3 before the kill, 4-7 resumed: bit for bit
    assert eval_losses(resumed.stdout)[8] == ef[8]
    ckr = read_checkpoint(killed)[1]
    for name, w in ckf['model'].items():
        assert torch.equal(ckr['model'][name], w), name
    for slot, state in ckf['optimizer']['state'].items():
        assert all(torch.equal(ckr['optimizer']['state'][slot][k], v) for k, v in state.items()), slot

    # the 2-rank sharded checkpoint resumes in one process (the other arithmetic of one process: within 1e-6)
    proc = run_script_in_process('train.py', [TINY, f'--dataset={data}', f'--out_dir={tmp_path / "one_rank"}', *args,
                                              '--max_iters=8', '--init_from=resume'])
    assert proc.returncode == 0, proc.stderr
    l_one_rank = logged_losses(tmp_path / 'one_rank')
    assert sorted(l_one_rank) == [4, 5, 6, 7]
    assert all(abs(l_one_rank[it] - lf[it]) <= 8 * torch.finfo(torch.float32).eps * lf[it] for it in l_one_rank)
    assert weights_differ(read_checkpoint(tmp_path / 'one_rank' / 'ckpt.pt')[1]['model'], ckf['model']) < 1e-6

    # consolidated into one ckpt.pt: the same tensors, the tied weight stored once; sample.py reads either
    proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={fsdp_dir}'])
    assert proc.returncode == 0 and f"wrote {fsdp_dir / 'ckpt.pt'}" in proc.stdout, proc.stderr
    whole = torch.load(fsdp_dir / 'ckpt.pt', weights_only=True)
    assert whole['model']['lm_head.weight'].data_ptr() == whole['model']['transformer.wte.weight'].data_ptr()
    assert all(torch.equal(whole['model'][k], v) for k, v in ckf['model'].items())
    assert whole['optimizer_param_names'] == ckd['optimizer_param_names']
    sample = ['--start=ab', '--num_samples=2', '--max_new_tokens=12', '--device=cpu', '--dtype=float32']
    from_sharded = run_script_in_process('sample.py', [f'--out_dir={killed}', *sample])
    from_file = run_script_in_process('sample.py', [f'--out_dir={fsdp_dir}', *sample])
    assert from_sharded.returncode == from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == from_sharded.stdout and from_file.stdout.count('---------------') == 2


@needs_cpu_fsdp
def test_every_attention_variant_steps_sharded_as_unsharded(tmp_path):
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           'tests/fsdp_steps.py', str(tmp_path)], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    results = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{')][-1])
    assert {k.split('/')[0] for k in results} == set(ATTENTION_TYPES)
    for case, r in results.items():
        bf16 = 'bfloat16' in case
        # float32: the same arithmetic but for the order of the reductions (measured <= 6e-7 in the weights,
        # 5e-7 in the summed losses); bf16: FSDP computes the forward in bf16 where the unsharded reference
        # keeps float32 under autocast (measured 7e-3 after 3 AdamW steps of lr 3e-3, losses 4e-4)
        assert r['weights'] < (2e-2 if bf16 else 2e-6) and r['loss'] < (5e-3 if bf16 else 1e-5), (case, r)
        assert r['tied'] and r['reloaded'], case
        if issubclass(ATTENTION_TYPES[case.split('/')[0]], NoiseFormerAttention):
            assert r['mu_moved'] > 1e-3, (case, r)  # its only gradient, the KL's, arrived
        # its sharded checkpoint (2 ranks, uneven shards for noiseformer_v1's one mu) read whole in this process:
        # exactly the gathered weights; AdamW's state by the same names as the unsharded run's, and as close
        saved, gathered = read_checkpoint(tmp_path / case.replace('/', '-'))[1], torch.load(
            tmp_path / case.replace('/', '-') / 'gathered.pt', weights_only=True)
        reference = read_checkpoint(tmp_path / case.replace('/', '-') / 'reference')[1]
        assert list(saved['model']) == list(gathered) and all(torch.equal(saved['model'][k], v) for k, v in gathered.items())
        assert saved['optimizer_param_names'] == reference['optimizer_param_names'] and saved['iter_num'] == 3
        for slot, state in reference['optimizer']['state'].items():
            for key, value in state.items():
                torch.testing.assert_close(saved['optimizer']['state'][slot][key], value, rtol=0,
                                           atol=2e-3 if bf16 else 1e-6)

    # base, consolidated by convert_checkpoint.py, is a checkpoint nanoGPT's code loads (strictly, by position)
    base = tmp_path / 'base-float32'
    assert run_script_in_process('convert_checkpoint.py', [f'--out_dir={base}']).returncode == 0
    checkpoint = torch.load(base / 'ckpt.pt', map_location='cpu', weights_only=True)
    nano = NanoGPT(NanoConfig(**checkpoint['model_args']))
    nano.load_state_dict(checkpoint['model'])
    nano_opt = nano.configure_optimizers(0.1, 3e-3, (0.9, 0.99))
    nano_opt.load_state_dict(checkpoint['optimizer'])
    ours = read_checkpoint(base)[1]
    params = dict(nano.named_parameters())
    for group, names in zip(nano_opt.param_groups, ours['optimizer_param_names']):  # nanoGPT's order is the file's
        assert len(names) == len(group['params']) and all(params[n] is p for n, p in zip(names, group['params']))
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours_model = model_with_weights(GPTConfig(**ours['model_args']), ours['model']).eval()
    y = torch.roll(x, -1, dims=1)
    (nano_logits, nano_loss), (our_logits, our_loss) = nano.eval()(x, y), ours_model(x, y)
    torch.testing.assert_close(nano_logits, our_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(nano_loss, our_loss, rtol=0, atol=1e-6)


def refused(tmp_path, *args):
    data = make_dataset(tmp_path, n_train=2000, n_val=500)
    proc = run_script_in_process('train.py', [TINY, f'--dataset={data}', f'--out_dir={tmp_path / "out"}', *args])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / 'out').exists()  # refused before out_dir was touched
    return proc.stderr


def test_bad_parallel_and_unsupported_fsdp_settings_are_refused_in_one_line(tmp_path):
    assert "parallel='zero' must be 'ddp' or 'fsdp'" in refused(tmp_path, '--parallel=zero')
    assert "parallel='fsdp' with compile=True is not supported yet" in refused(tmp_path, '--parallel=fsdp',
                                                                               '--compile=True')
    tiny_checkpoint(tmp_path / 'start', 'base', tmp_path / 'data')
    err = refused(tmp_path, '--parallel=fsdp', f'--init_from={tmp_path / "start"}', '--trainable=lora')
    assert "parallel='fsdp' with trainable='lora' is not supported yet" in err


@pytest.mark.skipif(CPU_STREAM_EVENTS, reason="this torch runs FSDP2 on the CPU (the tests above train it)")
def test_fsdp_on_the_cpu_is_refused_at_start_up_by_a_torch_that_cannot_run_it(tmp_path):
    err = refused(tmp_path, '--parallel=fsdp')
    assert "parallel='fsdp' on the CPU needs a torch whose CPU streams record events" in err
    assert f"torch {torch.__version__}" in err
