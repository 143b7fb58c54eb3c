"""
OpenWebText (Skylion007/openwebtext, the parquet version on the Hugging Face hub) as GPT-2 tokens:
train.bin / val.bin (flat uint16, nanoGPT-compatible) and meta.json, next to this file.

    python3 data/openwebtext/prepare.py                          # from the hub (tens of GB, once)
    python3 data/openwebtext/prepare.py --input 'owt/*.jsonl'    # local text/jsonl/parquet files

nanoGPT's split: 0.05% of the documents (seed 2357) go to val; about 9B train tokens from the hub.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for prepare_common
from prepare_common import main

if __name__ == "__main__":
    main(__doc__, hub_path="Skylion007/openwebtext", out_dir=os.path.dirname(os.path.abspath(__file__)))
