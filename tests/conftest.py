"""Test-wide setup: the repo on sys.path, and every library that could reach the network kept offline.

tiktoken's GPT-2 files come from ../shared/tiktoken (copied to a temp dir, since tiktoken may write
into its cache); Hugging Face and wandb are told they are offline. Nothing here downloads.
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

if "PYTEST_XDIST_WORKER" in os.environ:
    # one OpenMP thread per test worker (and the train.py processes it starts): with `-n 2` on two
    # cores, two workers each spinning two threads would slow each other several-fold
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)  # in case a plugin imported torch before this file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken").is_dir():
    _cache = tempfile.mkdtemp(prefix="tiktoken-cache-")
    for f in (SHARED / "tiktoken").iterdir():
        shutil.copy(f, _cache)
    os.environ["TIKTOKEN_CACHE_DIR"] = _cache

SHAKESPEARE = SHARED / "data" / "tinyshakespeare" / "input.txt"
