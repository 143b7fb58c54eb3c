"""configurator.apply_config: nanoGPT's config files and --key=value overrides, every key and type
checked; and every config file the project ships is valid for train.py."""
import dataclasses
import os
import runpy

import pytest
import torch

from configurator import (MIN_TORCH, ConfigError, apply_config, script_defaults, torch_too_old, variant_fields,
                          variant_settings)
from helpers import ROOT, TINY, run_script_in_process
from model import ATTENTION_TYPES, GPT, GPTConfig
DEFAULTS = {'batch_size': 12, 'learning_rate': 6e-4, 'compile': False, 'out_dir': 'out',
            'wandb_run_name': 'gpt2', 'n_layer': 12, 'anything': None}


def write(tmp_path, text, name='cfg.py'):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_file_then_cli_in_order_and_defaults_untouched(tmp_path):
    cfg = write(tmp_path, "batch_size = 4\nout_dir = 'out-a'\nlearning_rate = 1e-3\n")
    got = apply_config([cfg, '--batch_size=8', '--out_dir=out-b'], DEFAULTS)
    assert got == {**DEFAULTS, 'batch_size': 8, 'out_dir': 'out-b', 'learning_rate': 1e-3}
    assert DEFAULTS['batch_size'] == 12  # the defaults dict is not modified
    # a later file overrides an earlier override, as in nanoGPT (arguments apply left to right)
    assert apply_config(['--batch_size=8', cfg], DEFAULTS)['batch_size'] == 4


def test_file_typo_names_file_and_closest_key(tmp_path):
    cfg = write(tmp_path, "batch_size = 4\nn_layr = 6\n")
    with pytest.raises(ConfigError) as e:
        apply_config([cfg], DEFAULTS)
    assert cfg in str(e.value) and "'n_layr'" in str(e.value) and "did you mean 'n_layer'" in str(e.value)


def test_cli_typo_suggests_closest_key():
    with pytest.raises(ConfigError) as e:
        apply_config(['--batchsize=3'], DEFAULTS)
    msg = str(e.value)
    assert "--batchsize=3" in msg and "did you mean 'batch_size'" in msg
    with pytest.raises(ConfigError, match="unknown config key 'zzz'"):
        apply_config(['--zzz=1'], DEFAULTS)


def test_int_is_widened_to_float_but_other_mismatches_are_named(tmp_path):
    got = apply_config(['--learning_rate=1'], DEFAULTS)['learning_rate']
    assert got == 1.0 and type(got) is float
    assert type(apply_config([write(tmp_path, "learning_rate = 3\n")], DEFAULTS)['learning_rate']) is float
    with pytest.raises(ConfigError, match=r"batch_size must be an int like the default 12, got 1\.5 \(float\)"):
        apply_config(['--batch_size=1.5'], DEFAULTS)
    with pytest.raises(ConfigError, match="learning_rate must be a float.*got 'fast' \\(str\\)"):
        apply_config(['--learning_rate=fast'], DEFAULTS)
    cfg = write(tmp_path, "batch_size = '12'\n")
    with pytest.raises(ConfigError) as e:
        apply_config([cfg], DEFAULTS)
    assert cfg in str(e.value) and "batch_size must be an int" in str(e.value)


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "+Infinity", "NaN"])
def test_non_finite_float_on_the_command_line_is_read_as_in_a_config_file(tmp_path, text):
    # float('inf') in a config file is a float the script's range check names ("must be a finite number");
    # typed on the command line it was the string 'inf' ("must be a float"): the same value either way now
    cli = apply_config([f'--learning_rate={text}'], DEFAULTS)['learning_rate']
    from_file = apply_config([write(tmp_path, f"learning_rate = float({text!r})\n")], DEFAULTS)['learning_rate']
    assert type(cli) is float and repr(cli) == repr(from_file)
    with pytest.raises(ConfigError, match=r"batch_size must be an int like the default 12, got 'inf' \(str\)"):
        apply_config(['--batch_size=inf'], DEFAULTS)  # only float settings read these words


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_train_names_a_non_finite_setting_alike_from_command_line_and_file(tmp_path, value):
    cfg = write(tmp_path, f"weight_decay = float({value!r})\n")
    data = tmp_path / "data"  # token files that are there (train.py looks for them before the settings)
    data.mkdir()
    for split in ("train", "val"):
        (data / f"{split}.bin").touch()
    from_cli, from_file = (run_script_in_process('train.py', [TINY, *args, f'--out_dir={tmp_path / "out"}',
                                                              f'--dataset={data}'])
                           for args in ([f'--weight_decay={value}'], [cfg]))
    assert from_cli.returncode == from_file.returncode == 2
    assert from_cli.stderr == from_file.stderr == f"train.py: error: weight_decay={value} must be a finite number\n"


def test_bools_from_true_false_only():
    assert apply_config(['--compile=True'], DEFAULTS)['compile'] is True
    assert apply_config(['--compile=False'], DEFAULTS)['compile'] is False
    assert apply_config(['--compile=true'], DEFAULTS)['compile'] is True
    for bad in ('1', 'yes', '0'):
        with pytest.raises(ConfigError, match="compile must be True or False"):
            apply_config([f'--compile={bad}'], DEFAULTS)
    with pytest.raises(ConfigError, match="batch_size must be an int"):  # bool is not an int here
        apply_config(['--batch_size=True'], DEFAULTS)


def test_values_with_equals_signs_and_string_keys_keep_what_was_typed():
    assert apply_config(['--out_dir=a=b=c'], DEFAULTS)['out_dir'] == 'a=b=c'
    assert apply_config(['--wandb_run_name=124'], DEFAULTS)['wandb_run_name'] == '124'
    assert apply_config(["--out_dir='quoted'"], DEFAULTS)['out_dir'] == 'quoted'
    assert apply_config(['--anything=[1, 2]'], DEFAULTS)['anything'] == [1, 2]  # None accepts any type


def test_malformed_arguments_and_files(tmp_path):
    with pytest.raises(ConfigError, match="--key=value"):
        apply_config(['--compile'], DEFAULTS)
    with pytest.raises(ConfigError, match="not found") as missing:
        apply_config([str(tmp_path / 'missing.py')], DEFAULTS)
    assert 'did you mean' not in str(missing.value)
    (tmp_path / 'train_shakespeare_char.py').write_text("batch_size = 4\n")
    with pytest.raises(ConfigError, match=f"did you mean {tmp_path / 'train_shakespeare_char.py'}"):
        apply_config([str(tmp_path / 'train_shakespear_char.py')], DEFAULTS)  # a letter short
    with pytest.raises(ConfigError, match="is a folder: give a config file"):
        apply_config([str(tmp_path)], DEFAULTS)
    os.mkfifo(tmp_path / 'fifo.py')  # refused before it is opened: opening it would wait for a writer
    with pytest.raises(ConfigError, match=r"is not a regular file \(a FIFO"):
        apply_config([str(tmp_path / 'fifo.py')], DEFAULTS)
    with pytest.raises(ConfigError, match="need two dashes"):
        apply_config(['batch_size=3'], DEFAULTS)
    # read whole and executed: a huge file (a 6 GB line, /dev/zero copied) or one not UTF-8 is named, not read on
    (tmp_path / 'huge.py').write_bytes(b'#' * (2 << 20))
    with pytest.raises(ConfigError, match=r"huge.py is larger than 1 MiB, which no config file is"):
        apply_config([str(tmp_path / 'huge.py')], DEFAULTS)
    (tmp_path / 'latin1.py').write_bytes("batch_size = 4  # réglé\n".encode('latin-1'))
    with pytest.raises(ConfigError, match=r"latin1.py is not UTF-8 text \(byte 19\)"):
        apply_config([str(tmp_path / 'latin1.py')], DEFAULTS)
    cfg = write(tmp_path, "batch_size = 4\nn_layer = (\n")
    with pytest.raises(ConfigError, match=f"{cfg}, line 2"):
        apply_config([cfg], DEFAULTS)
    cfg = write(tmp_path, "import os\nbatch_size = 4\n", name='imp.py')
    with pytest.raises(ConfigError, match="'os' is a module"):
        apply_config([cfg], DEFAULTS)
    cfg = write(tmp_path, "batch_size = 4 * undefined_name\n", name='name.py')
    with pytest.raises(ConfigError, match=f"{cfg}, line 1: NameError"):
        apply_config([cfg], DEFAULTS)
    assert issubclass(ConfigError, ValueError)


# -----------------------------------------------------------------------------
# The shipped config files against train.py's real defaults

def train_defaults():
    """train.py's settings, read from its source (so this test does not run the script)."""
    return script_defaults(str(ROOT / 'train.py'))


CONFIGS = sorted(p.name for p in (ROOT / 'config').glob('*.py') if not p.name.startswith('compare_'))
COMPARE_CONFIGS = sorted(p.name for p in (ROOT / 'config').glob('compare_*.py'))
# each variant's GPT-2-small recipe: config/<attn_type>.py (base's is nanoGPT's train_gpt2.py)
PAPER_CONFIGS = {('train_gpt2.py' if a == 'base' else f'{a}.py'): a for a in ATTENTION_TYPES}


def test_train_defaults_match_gptconfig_defaults():
    # train.py lists the model-wide fields for readability; they must not drift from GPTConfig, or a
    # default run would set a variant field on a variant that rejects it
    defaults = train_defaults()
    for f in dataclasses.fields(GPTConfig):
        if f.name not in ('vocab_size', 'bias'):  # vocab from the data; bias=False as nanoGPT's train.py
            assert defaults[f.name] == f.default, f.name


def model_config(config):
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in config.items() if k in fields}, vocab_size=50304)


@pytest.mark.parametrize('name', CONFIGS)
def test_shipped_config_is_valid(name):
    """Every key the file assigns is one of train.py's settings, of its default's type, and the run
    gets the file's value; the model is the one the file describes: its attn_type (train.py's
    default when it names none) and every size it sets, and it builds."""
    path = ROOT / 'config' / name
    assigned = {k: v for k, v in runpy.run_path(str(path)).items() if not k.startswith('__')}
    defaults = train_defaults()
    config = apply_config([str(path)], defaults)
    assert assigned and set(assigned) <= set(defaults), sorted(set(assigned) - set(defaults))
    for key, value in assigned.items():
        assert config[key] == value, key
        # a float setting takes an int as a float; compile takes True / False as well as 'auto'
        types = {type(defaults[key])} | ({bool} if key == 'compile' else set())
        assert defaults[key] is None or type(config[key]) in types, (key, config[key], defaults[key])
    gpt_config = model_config(config)  # GPTConfig validates attn_type, head counts and variant fields
    assert gpt_config.attn_type == assigned.get('attn_type', defaults['attn_type'])
    for f in dataclasses.fields(GPTConfig):
        if f.name in assigned:
            assert getattr(gpt_config, f.name) == assigned[f.name], f.name
    with torch.device('meta'):  # every shape, no memory or init time
        model = GPT(gpt_config)
    assert len(model.transformer.h) == gpt_config.n_layer
    assert all(type(block.attn) is ATTENTION_TYPES[gpt_config.attn_type] for block in model.transformer.h)


@pytest.mark.parametrize('name', COMPARE_CONFIGS)
def test_shipped_compare_config_is_valid(name):
    from configurator import script_defaults
    config = apply_config([str(ROOT / 'config' / name)], script_defaults(str(ROOT / 'compare.py')))
    assert set(config['attn_types']) <= set(ATTENTION_TYPES) and len(config['seeds']) >= 2
    # every run's settings: the base config and the overrides are valid train.py settings
    import shlex
    train = apply_config([str(ROOT / config['base_config']), *shlex.split(config['overrides'])], train_defaults())
    model_config(train)


def test_paper_configs_share_the_recipe():
    missing = sorted(set(PAPER_CONFIGS) - set(CONFIGS))
    assert not missing, f"no GPT-2-small recipe config/{missing[0]}: copy config/train_gpt2.py and set attn_type"
    recipe = dict(batch_size=12, block_size=1024, gradient_accumulation_steps=40, learning_rate=6e-4,
                  beta1=0.9, beta2=0.95, weight_decay=0.1, grad_clip=1.0, warmup_iters=2000,
                  lr_decay_iters=600000, min_lr=6e-5, max_iters=100000, eval_interval=1000,
                  eval_iters=200, kl_weight=5e-6, n_layer=12, n_head=12, n_embd=768, dropout=0.0)
    out_dirs = set()
    for name, attn_type in PAPER_CONFIGS.items():
        config = apply_config([str(ROOT / 'config' / name)], train_defaults())
        assert config['attn_type'] == attn_type
        assert {k: config[k] for k in recipe} == recipe, name
        out_dirs.add(config['out_dir'])
    assert len(out_dirs) == len(PAPER_CONFIGS)  # runs of different variants never share a checkpoint


def test_paper_models_build():
    # every variant's 124M model, on the meta device: every shape is built, no memory or init time spent
    counts = {}
    for name, attn_type in PAPER_CONFIGS.items():
        with torch.device('meta'):
            model = GPT(model_config(apply_config([str(ROOT / 'config' / name)], train_defaults())))
        counts[attn_type] = model.get_num_params()
    assert 120e6 < counts['base'] < 126e6
    assert counts['base'] - counts['symmetric'] == 12 * 768 * 768  # no key projection (bias=False)


# -----------------------------------------------------------------------------
# --help and "given"

def test_given_records_every_key_set_even_to_its_default(tmp_path):
    cfg = write(tmp_path, "batch_size = 12\n")  # the default's value, but given
    given = set()
    apply_config([cfg, '--out_dir=out', '--n_layer=3'], DEFAULTS, given=given)
    assert given == {'batch_size', 'out_dir', 'n_layer'}


# each script once (a subprocess costs seconds of imports); -h and --help are the same code path
@pytest.mark.parametrize('script, flag', [('train.py', '--help'), ('sample.py', '-h'), ('bench.py', '--help'),
                                          ('compare.py', '--help'), ('eval.py', '-h'), ('export_hf.py', '--help'),
                                          ('convert_checkpoint.py', '--help')])
def test_help_lists_every_key_with_default_and_meaning(script, flag):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, script, flag], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"usage: python3 {script}" in r.stdout
    keys = list(script_defaults(str(ROOT / script)))
    if script in ('train.py', 'bench.py'):
        assert set(variant_settings()) <= set(keys)
    lines = {line.split('=')[0].strip(): line for line in r.stdout.splitlines() if line.strip().startswith('--')}
    for key in keys:
        assert f'--{key}' in lines, key
        default_and_meaning = lines[f'--{key}'].split('=', 1)[1]
        assert '  ' in default_and_meaning.strip(), f"{script}: --{key} has no meaning (comment on its line)"


def test_the_scripts_take_every_variant_setting_from_gptconfig():
    """train.py and bench.py take each field a variant's config_fields names, with GPTConfig's default, in its
    order: a variant's setting is written once, in model.py (read from its source, before torch loads)."""
    used = {name for cls in ATTENTION_TYPES.values() for name in cls.config_fields}
    expected = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name in used}
    assert expected and variant_settings() == expected and list(variant_settings()) == list(expected)
    assert all(meaning for _, meaning in variant_fields().values())  # the comment on the field's line
    for script in ('train.py', 'bench.py'):
        assert script_defaults(str(ROOT / script)).items() >= expected.items(), script
    with pytest.raises(ConfigError, match=r"unknown config key 'noise_init_sd'; did you mean 'noise_init_std'\?"):
        apply_config(['--noise_init_sd=0.1'], train_defaults())


def test_a_field_a_new_variant_reads_is_a_setting_with_its_meaning(tmp_path):
    model = (ROOT / 'model.py').read_text().replace(
        "    linear_chunk_size: int = 64", "    rope_base: float = 1e4  # rope: the base of the rotary angles\n"
                                         "    linear_chunk_size: int = 64")
    model += "\n\nclass RopeAttention(CausalSelfAttention):\n    config_fields = ('qk_head_size', 'rope_base')\n"
    (tmp_path / 'model.py').write_text(model)
    fields = variant_fields(str(tmp_path / 'model.py'))
    assert fields['rope_base'] == (1e4, 'rope: the base of the rotary angles')
    names = list(fields)
    assert names[names.index('rope_base') + 1] == 'linear_chunk_size'  # GPTConfig's order


def test_list_keys_take_python_lists_or_comma_separated_values(tmp_path):
    defaults = {'attn_types': ['base'], 'seeds': [1]}
    assert apply_config(['--attn_types=base,diff', '--seeds=1,2'], defaults) == {'attn_types': ['base', 'diff'], 'seeds': [1, 2]}
    assert apply_config(["--attn_types=['dint']", '--seeds=7'], defaults) == {'attn_types': ['dint'], 'seeds': [7]}
    assert apply_config([write(tmp_path, "seeds = (3, 4)\n")], defaults)['seeds'] == [3, 4]
    with pytest.raises(ConfigError, match="seeds must be a list"):
        apply_config([write(tmp_path, "seeds = 5\n", name='bad.py')], defaults)


def test_optional_bool_keeps_none_and_reads_true_false_in_any_case():
    from configurator import optional_bool
    assert optional_bool('noise_at_eval', None) is None
    assert optional_bool('noise_at_eval', 'FALSE') is False and optional_bool('noise_at_eval', True) is True
    for bad in ('maybe', 1, 0.0):  # 1 == True, but a number is not an on/off answer
        with pytest.raises(ConfigError, match=r"noise_at_eval=.* must be True or False"):
            optional_bool('noise_at_eval', bad)


def test_help_is_answered_before_torch_is_imported():
    """--help costs a fraction of a second: every script answers it from its source, before its heavy
    imports (torch alone takes 1.5-2 s to import here), with the same text as before."""
    import subprocess
    import sys
    code = '''
import contextlib, io, runpy, sys
for script in ('train.py', 'sample.py', 'bench.py', 'eval.py', 'compare.py', 'grow.py', 'export_hf.py',
               'convert_checkpoint.py'):
    sys.argv = [script, '--help']
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(script, run_name='__main__')
        except SystemExit as e:
            assert e.code in (0, None), (script, e.code)
    assert f"usage: python3 {script}" in out.getvalue(), script
    assert 'torch' not in sys.modules, f"{script} imported torch before answering --help"
'''
    r = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_torch_older_than_the_bound_is_named_in_one_line():
    """answer_help refuses a torch below requirements.txt's bound from its version string (the installed
    torch here is not one, so the string is given)."""
    bound = next(line for line in (ROOT / 'requirements.txt').read_text().splitlines() if line.startswith('torch>='))
    assert MIN_TORCH == tuple(int(n) for n in bound.removeprefix('torch>=').split('.'))  # the same bound
    for old in ('2.5.1a0+gitc8f2e2a', '2.4.0', '1.13.1+cu117'):
        message = torch_too_old(old)
        assert message.startswith(f"torch {old} is older than 2.6") and '\n' not in message
    for fine in ('2.6.0+cu124', '2.9.0a0+git', '2.10.0', '2.13.0+cpu', '3.0.0'):
        assert torch_too_old(fine) is None, fine  # 2.10 is newer than 2.6: numbers, not strings
    assert torch_too_old(torch.__version__) is None  # the torch these tests run on
