"""denoised_gpt/cli.py: what every script does the same way (settings checks, loading GPT-2's weights)."""
import hashlib
import os
import pickle
import shutil
import signal
import string
import subprocess
import sys

import pytest

from denoised_gpt.cli import R50K_BASE_URL, check_attn_types, check_ranges, gpt2_encoding
from helpers import ROOT, VOCAB, make_dataset, subprocess_env, tiny_checkpoint


@pytest.mark.slow
def test_unreachable_hub_fails_at_once_without_retries(tmp_path):
    """An endpoint that refuses connections (port 9 on this machine) and an empty cache: the hub client
    alone would retry for about 50 s; the script must give its one-line error inside 40 s (room for a torch
    import slowed by other jobs)."""
    env = {k: v for k, v in subprocess_env(HF_HOME=str(tmp_path / 'hf'), HF_ENDPOINT='http://127.0.0.1:9').items()
           if k != 'HF_HUB_OFFLINE'}
    proc = subprocess.run([sys.executable, 'sample.py', '--init_from=gpt2', '--device=cpu'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=40)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "sample.py: error: could not fetch the 'gpt2' weights: not in the local cache, and the Hugging Face hub "
        "is offline or unreachable. Connect to the network once (they are cached), or pass "
        "--init_from=/path/to/a/folder/saved/by/transformers/save_pretrained")


def test_attn_types_name_the_closest_valid_one():
    with pytest.raises(ValueError, match=r"unknown 'noiseformer2' \(did you mean 'noiseformer_v2'\?\), 'zzz'; "
                                         r"choose from base, symmetric"):
        check_attn_types(['base', 'noiseformer2', 'zzz'])
    with pytest.raises(ValueError, match="empty; use 'all' or a comma-separated list of base"):
        check_attn_types([], all_allowed=True)
    check_attn_types(['base', 'dint_lowrank'])


@pytest.mark.parametrize('config,kind,message', [
    (dict(lr=float('inf')), {}, "lr=inf must be a finite number"),
    (dict(n=0), dict(at_least_one=('n',)), "n=0 must be at least 1"),
    (dict(grad_clip=-1.0), dict(non_negative=('grad_clip',)), "grad_clip=-1.0 must not be negative (0 turns"),
    (dict(beta2=1.0), dict(unit_interval=('beta2',)), "beta2=1.0 must be in [0, 1)"),
    (dict(learning_rate=0.0), dict(positive=('learning_rate',)), "learning_rate=0.0 must be positive"),
    (dict(seed=2 ** 63), dict(seeds=('seed',)), "must be a non-negative integer below 2**63"),
    (dict(seed=-1), dict(seeds=('seed',)), "seed=-1 must be a non-negative integer"),
    # a number of thousands of digits, shortened: one line stays one line
    (dict(seed=10**4000), dict(seeds=('seed',)), "seed=100000000000... (4,001 digits) must be a non-negative integer"),
    (dict(rounds=10**40), dict(at_most={'rounds': (10, "rounds")}),
     "rounds=100000000000... (41 digits) is over the limit of 10 rounds"),
])
def test_check_ranges_names_the_setting(config, kind, message):
    with pytest.raises(ValueError) as e:
        check_ranges(config, **kind)
    assert message in str(e.value)
    ok = {k: (1 if isinstance(v, int) else 0.5) for k, v in config.items()}
    check_ranges(ok, **kind)  # a good value of the same setting passes


@pytest.mark.parametrize('attn_type', ['base', 'noiseformer_v2', 'dint_lowrank', 'linear'])
def test_model_built_on_meta_with_weights_equals_the_loaded_model(attn_type):
    import torch
    from denoised_gpt.weights import model_with_weights
    from helpers import tiny_gpt
    trained = tiny_gpt(attn_type, seed=3)
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    model = model_with_weights(trained.config, state)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as GPT ties them
    assert model.get_num_params() == trained.get_num_params()
    for k, v in trained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    idx = torch.randint(0, trained.config.vocab_size, (2, 16))
    trained.eval(), model.eval()
    torch.manual_seed(0)
    a = trained(idx)[0]
    torch.manual_seed(0)
    b = model(idx)[0]
    assert torch.equal(a, b)


def test_weights_missing_or_extra_are_refused_in_one_line_naming_them():
    import torch
    from denoised_gpt.weights import model_with_weights
    from helpers import tiny_gpt
    trained = tiny_gpt('base', seed=3)
    state = trained.state_dict()
    blocks = [k for k in state if k.startswith('transformer.h.')]
    fit = "checkpoint ckpt.pt does not fit its own model_args: "
    fix = " (written by another version, or edited): load it with the code that wrote it"
    cases = [
        ({k: v for k, v in state.items() if k != 'transformer.ln_f.weight'},
         "it lacks 1 tensor of the model they describe (transformer.ln_f.weight)"),
        ({**state, 'transformer.extra': torch.zeros(2)},
         "it has 1 tensor the model has no place for (transformer.extra)"),
        ({k: v for k, v in state.items() if k not in blocks[:4]} | {'x.' + k: state[k] for k in blocks[:1]},
         f"it lacks 4 tensors of the model they describe ({', '.join(blocks[:3])}, ...); "
         f"it has 1 tensor the model has no place for (x.{blocks[0]})"),
    ]
    for bad, names in cases:
        with pytest.raises(ValueError) as e:
            model_with_weights(trained.config, bad, source='ckpt.pt')
        assert str(e.value) == fit + names + fix


def test_gpt2_encoding_takes_the_compact_file_when_cached_and_gpt2s_files_otherwise(tmp_path, monkeypatch):
    """r50k_base is GPT-2's BPE in one compact file (faster to load): taken when tiktoken has it cached,
    else 'gpt2' from its two files, with no download attempted for the other. Both encode alike."""
    import tiktoken
    r50k_file = hashlib.sha1(R50K_BASE_URL.encode()).hexdigest()
    shared = os.environ.get("TIKTOKEN_CACHE_DIR")  # the offline copy of tiktoken's files (.ci/run)
    if not shared or not os.path.isfile(os.path.join(shared, r50k_file)):
        pytest.skip("needs tiktoken's files, r50k_base's among them, in TIKTOKEN_CACHE_DIR")
    only_gpt2 = tmp_path / "only_gpt2"
    shutil.copytree(shared, only_gpt2, ignore=shutil.ignore_patterns(r50k_file))
    text = "Once upon a time<|endoftext|> there was  a tokenizer\n"
    encodings = {}
    for cache, name in ((shared, "r50k_base"), (str(only_gpt2), "gpt2")):
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache)
        tiktoken.registry.ENCODINGS.clear()  # tiktoken keeps each loaded encoding for the process
        enc = gpt2_encoding()
        assert enc.name == name
        encodings[name] = enc.encode(text, allowed_special={"<|endoftext|>"})
    assert encodings["r50k_base"] == encodings["gpt2"] and 50256 in encodings["gpt2"]
    assert sorted(os.listdir(only_gpt2)) == sorted(f for f in os.listdir(shared) if f != r50k_file)  # no download


@pytest.mark.slow
@pytest.mark.parametrize('script,args', [
    ('sample.py', ['--max_new_tokens=1000000', '--num_samples=1000']),
    ('eval.py', ['--entropy=True', '--entropy_batches=1000000']),
], ids=['sample.py', 'eval.py'])
def test_ctrl_c_ends_sample_and_eval_in_one_line(tmp_path, script, args):
    """Ctrl-C (SIGINT) in the middle of the work: exit status 130 and one line, no KeyboardInterrupt
    traceback (train.py checkpoints and says one line too: test_train.py)."""
    data = make_dataset(tmp_path)
    chars = '\n' + string.ascii_letters[:VOCAB - 1]  # nanoGPT's char-level meta.pkl: sample.py's vocabulary
    with open(data / 'meta.pkl', 'wb') as f:
        pickle.dump({'vocab_size': VOCAB, 'itos': dict(enumerate(chars)), 'stoi': {c: i for i, c in enumerate(chars)}}, f)
    tiny_checkpoint(tmp_path / 'out', 'base', data)
    proc = subprocess.Popen([sys.executable, str(ROOT / script), f"--out_dir={tmp_path / 'out'}", '--device=cpu',
                             *args], cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    line = ''
    while 'device cpu' not in line:  # its log line once the model is loaded: the long part begins
        line = proc.stderr.readline()
        assert line, "the script ended before its work began"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and 'Traceback' not in err, err
    assert err.strip().splitlines() == [f"{script}: interrupted"]
