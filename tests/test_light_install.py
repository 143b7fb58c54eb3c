"""The light install (requirements.txt: training, sampling, data) and the extras (requirements-extras.txt): a
script that needs an extra that is not installed says which and the command that installs it, in one line,
before any work. 'Not installed' is made here by hiding the package from import (sys.modules[name] = None)."""
import pytest

from denoised_gpt.extras import INSTALL
from helpers import ROOT, make_dataset, run_script_in_process, tiny_checkpoint

EXTRAS = {'lm_eval': 'lm-eval', 'matplotlib': 'matplotlib', 'peft': 'peft',
          'transformers': 'transformers'}  # import name: package name


def requirements(name):
    return {line.split('>=')[0].split('#')[0].strip() for line in (ROOT / name).read_text().splitlines()
            if line.strip() and not line.startswith('#')}


def test_the_light_install_leaves_the_extras_out():
    light, extras = requirements('requirements.txt'), requirements('requirements-extras.txt')
    assert {'torch', 'numpy', 'tiktoken', 'datasets', 'wandb', 'tqdm'} <= light
    assert extras == set(EXTRAS.values()) and not light & extras


def hide(monkeypatch, *modules):
    for module in modules:
        monkeypatch.setitem(__import__('sys').modules, module, None)


def one_line_refusal(proc, script, what, module):
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"{script}: error: {what} needs {module}, which the light "
                                                    f"install (requirements.txt) leaves out: {INSTALL}")


@pytest.mark.parametrize('measure', ['--entropy=True', '--retrieval=True'])
def test_eval_heatmaps_without_matplotlib(tmp_path, monkeypatch, measure):
    data = make_dataset(tmp_path)
    tiny_checkpoint(tmp_path / 'out', 'base', data)
    hide(monkeypatch, 'matplotlib')
    proc = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out'}", measure, '--device=cpu'])
    one_line_refusal(proc, 'eval.py', "drawing the heatmaps of --entropy, --attention_noise and --retrieval", 'matplotlib')
    assert not list((tmp_path / 'out').glob('*.json'))  # refused before any work


def test_compare_without_matplotlib_refuses_before_training(tmp_path, monkeypatch):
    hide(monkeypatch, 'matplotlib')
    proc = run_script_in_process('compare.py', [f"--out_dir={tmp_path / 'sweep'}", '--attn_types=base'])
    one_line_refusal(proc, 'compare.py', "compare.py's report (its plots)", 'matplotlib')
    assert not (tmp_path / 'sweep').exists()


def test_lora_without_peft(tmp_path, monkeypatch):
    data = make_dataset(tmp_path)
    tiny_checkpoint(tmp_path / 'base', 'base', data)
    hide(monkeypatch, 'peft')
    proc = run_script_in_process('train.py', [str(ROOT / 'tests' / 'config_tiny.py'), f'--dataset={data}',
                                              f"--init_from={tmp_path / 'base'}", '--trainable=lora',
                                              f"--out_dir={tmp_path / 'lora'}"])
    one_line_refusal(proc, 'train.py', "trainable='lora'", 'peft')


def test_export_without_transformers(tmp_path, monkeypatch):
    data = make_dataset(tmp_path)
    tiny_checkpoint(tmp_path / 'out', 'diff', data)
    hide(monkeypatch, 'transformers')
    proc = run_script_in_process('export_hf.py', [f"--out_dir={tmp_path / 'out'}", f"--hf_dir={tmp_path / 'hf'}"])
    one_line_refusal(proc, 'export_hf.py', "export_hf.py", 'transformers')
    assert not (tmp_path / 'hf').exists()
