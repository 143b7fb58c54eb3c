"""Test-wide setup: the repo on sys.path, every library that could reach the network kept offline,
and the fixtures several test files use.

tiktoken's GPT-2 files are not provided here: they come from TIKTOKEN_CACHE_DIR, tiktoken's default
cache or a download, as the README says (tests/gpt2_bpe.py skips the tests that need them when none
of those works). Hugging Face and wandb are told they are offline.
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the shared test modules' asserts (run_train's exit status, ...) report their values like a test's own
pytest.register_assert_rewrite('helpers', 'nanogpt_reference', 'fake_gaudi', 'gpt2_bpe')

if "PYTEST_XDIST_WORKER" in os.environ:
    # one OpenMP thread per test worker (and the train.py processes it starts): with `-n 2` on two
    # cores, two workers each spinning two threads would slow each other several-fold
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)  # in case a plugin imported torch before this file

# Triton kernels (denoised_gpt/noise_kernel.py) run on a CPU under Triton's interpreter, which triton reads when it is
# imported and when a kernel runs: set before anything imports triton. Nothing else uses triton without a GPU.
if "TRITON_INTERPRET" not in os.environ:
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# the libraries whose APIs the project calls into, named with their versions at the top of every run:
# README's "Tested with" table is this line of the last green run
TESTED_WITH = ('torch', 'numpy', 'tiktoken', 'datasets', 'pyarrow', 'wandb', 'transformers', 'tokenizers',
               'safetensors', 'huggingface_hub', 'peft', 'lm_eval', 'accelerate', 'matplotlib', 'triton', 'pytest')


def pytest_report_header(config):
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return 'not installed'
    return "tested with: " + ", ".join(f"{name} {installed(name)}" for name in TESTED_WITH)


# The test files that take 25 s or more (trainings in subprocesses: sweeps, torchrun, kill and resume;
# lm-eval), longest first as measured. `-n 2 --dist loadfile` hands whole files to the two workers in the
# order of this list, then the other files in collection order: the long ones start at once and the short
# ones fill in at the end, instead of one long file running alone on one worker after the other has finished.
SLOW_FILES = ['test_compare.py', 'test_fsdp.py', 'test_compile.py', 'test_train.py', 'test_recall.py',
              'test_hf_export.py', 'test_stop_at_val_loss.py', 'test_eval_lm.py', 'test_finetune.py',
              'test_out_dir.py', 'test_grow.py', 'test_bench.py', 'test_settings_fuzz.py']


def pytest_configure(config):
    # the quick first check, -m "not slow", leaves these out (README); CI runs everything
    config.addinivalue_line("markers", "slow: a test of many seconds: the scripts run end to end in subprocesses "
                            "(training, sweeps, torchrun, signals, kill -9), compiles, the Triton kernel's "
                            "equations under its interpreter")
    # by default xdist reorders loadfile's files by their number of tests (most first), which left
    # test_fsdp.py (three long tests) to the very end: keep the order set below instead
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """SLOW_FILES first, in that order; each file's tests stay together, in their own order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # a stable sort


@pytest.fixture
def fake_habana(tmp_path):
    """(env, log path) for a train.py subprocess on a fake Intel Gaudi (tests/fake_gaudi.py): PYTHONPATH
    puts the fake habana_frameworks first, and it logs what it is called for into the log file."""
    import fake_gaudi
    from helpers import subprocess_env
    site = fake_gaudi.install(tmp_path / 'fake_site')
    log = tmp_path / 'hpu.log'
    env = subprocess_env(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", FAKE_HPU_LOG=str(log))
    return env, log
