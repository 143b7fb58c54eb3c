"""
Tiny Shakespeare at the character level, exactly as nanoGPT: the first 90% of the text is
train.bin, the last 10% val.bin (uint16 character ids), meta.pkl {vocab_size, itos, stoi}, plus
meta.json {tokenizer: 'char', vocab_size, chars, train_tokens, val_tokens, train_max_id,
val_max_id, source}.

    python3 data/shakespeare_char/prepare.py                    # downloads input.txt here once (1.1 MB)
    python3 data/shakespeare_char/prepare.py --input input.txt  # a local copy, no network
"""
import argparse
import os
import pickle
import sys
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for prepare_common
from prepare_common import PrepareError, atomic_outputs, check_out_dir, max_id, one_line_errors, write_json

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
HERE = os.path.dirname(os.path.abspath(__file__))


def read_text(path):
    """The local file if given or already downloaded, else download it to `path` (as nanoGPT)."""
    if not os.path.exists(path):
        print(f"downloading {URL}")
        try:
            with urllib.request.urlopen(URL, timeout=30) as r:
                data = r.read()
        except OSError as e:
            sys.exit(f"error: could not download {URL} ({e}).\nWith no network, get input.txt (the Tiny Shakespeare "
                     f"text, 1,115,394 bytes) elsewhere and pass --input path/to/input.txt, or put it at {path}")
        with atomic_outputs(os.path.dirname(path), [os.path.basename(path)]) as tmp:
            with open(tmp[os.path.basename(path)], "wb") as f:
                f.write(data)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text (byte {e.start}); give the Tiny Shakespeare input.txt or "
                           f"convert the file to UTF-8") from e
    except OSError as e:
        raise PrepareError(f"{path}: cannot read it ({e.strerror or e}); give a text file you can read") from e
    if len(text) < 2:  # 90% of fewer than 2 characters leaves train.bin empty, nothing to train on
        what = "holds no text (the file is empty)" if not text else "holds only 1 character, none left for train.bin"
        raise PrepareError(f"{path} {what}; give the Tiny Shakespeare input.txt or another text file")
    return text


def prepare(args):
    if args.input is not None and os.path.isdir(args.input):
        raise PrepareError(f"--input {args.input} is a folder, not a text file; give the path of the Tiny "
                           f"Shakespeare input.txt")
    if args.input is not None and not os.path.exists(args.input):
        raise PrepareError(f"--input {args.input} does not exist; give the path of the Tiny Shakespeare input.txt")
    check_out_dir(args.out_dir)

    data = read_text(args.input or os.path.join(args.out_dir, "input.txt"))
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = len(data)
    train_ids = np.array([stoi[c] for c in data[:int(n * 0.9)]], dtype=np.uint16)
    val_ids = np.array([stoi[c] for c in data[int(n * 0.9):]], dtype=np.uint16)

    with atomic_outputs(args.out_dir, ["train.bin", "val.bin", "meta.pkl", "meta.json"]) as tmp:
        train_ids.tofile(tmp["train.bin"])
        val_ids.tofile(tmp["val.bin"])
        with open(tmp["meta.pkl"], "wb") as f:
            pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
        # 'chars' (the vocabulary in id order) lets meta.json alone decode, without the pickle
        write_json(tmp["meta.json"], {"tokenizer": "char", "vocab_size": len(chars), "chars": "".join(chars),
                                      "train_tokens": len(train_ids), "val_tokens": len(val_ids),
                                      "train_max_id": max_id(train_ids), "val_max_id": max_id(val_ids),
                                      "source": args.input or URL})
    print(f"vocab size {len(chars)}; train {len(train_ids):,} tokens, val {len(val_ids):,} tokens; wrote {args.out_dir}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="a local Tiny Shakespeare input.txt (default: OUT_DIR/input.txt, downloaded if missing)")
    p.add_argument("--out_dir", default=HERE, help="where train.bin, val.bin, meta.pkl, meta.json go (default: %(default)s)")
    args = p.parse_args()
    with one_line_errors():
        prepare(args)
