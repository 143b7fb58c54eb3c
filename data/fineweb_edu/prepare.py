"""
FineWeb-Edu (HuggingFaceFW/fineweb-edu, config sample-10BT: about 10B GPT-2 tokens) as GPT-2
tokens: train.bin / val.bin (flat uint16, nanoGPT-compatible) and meta.json, next to this file.

    python3 data/fineweb_edu/prepare.py                               # the whole 10BT sample
    python3 data/fineweb_edu/prepare.py --max_tokens 1_000_000_000    # a 1B-token train.bin
    python3 data/fineweb_edu/prepare.py --input 'fw/*.parquet'        # local files instead

From the hub, --max_tokens only tokenises the documents it needs (the download is still the whole
sample); with --input, every document is tokenised and train.bin then stops at the budget.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for prepare_common
from prepare_common import main

if __name__ == "__main__":
    main(__doc__, hub_path="HuggingFaceFW/fineweb-edu", hub_name="sample-10BT",
         out_dir=os.path.dirname(os.path.abspath(__file__)))
