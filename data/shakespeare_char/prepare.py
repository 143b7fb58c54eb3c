"""
Tiny Shakespeare at the character level, exactly as nanoGPT: the first 90% of the text is
train.bin, the last 10% val.bin (uint16 character ids), meta.pkl {vocab_size, itos, stoi}, plus
meta.json {tokenizer: 'char', vocab_size, chars, train_tokens, val_tokens, train_max_id,
val_max_id, source}.

    python3 data/shakespeare_char/prepare.py                    # downloads input.txt here once (1.1 MB)
    python3 data/shakespeare_char/prepare.py --input input.txt  # a local copy, no network

Any UTF-8 text of at most 1 GiB works the same way (enwik9's 10^9 bytes fit), with at most 65,536
distinct characters (the token files hold uint16 ids).
"""
import argparse
import os
import pickle
import stat
import sys
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for prepare_common
from prepare_common import (PrepareError, atomic_outputs, check_out_dir, dead_link, max_id, one_line_errors,
                            write_array, write_json)

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
HERE = os.path.dirname(os.path.abspath(__file__))
MAX_INPUT_BYTES = 1 << 30  # the text is read whole: 1 GiB of it needs about 4 GiB of memory here
MAX_CHARS = 1 << 16  # distinct characters: ids 0 .. 65535 fit the token files' uint16
ENCODE_CHARS = 1 << 24  # characters turned into ids per step: the memory beyond the text and its ids stays small


def check_input(path):
    """PrepareError unless path is a regular file of at most MAX_INPUT_BYTES: asked of os.stat before the file
    is opened, so that /dev/zero (endless), a FIFO (open waits for a writer) or a folder is never read."""
    link = dead_link(path)
    if link:
        raise PrepareError(f"{path} is {link}; point it at the Tiny Shakespeare input.txt, or give that file's "
                           f"path with --input")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PrepareError(f"--input {path} does not exist; give the path of the Tiny Shakespeare input.txt") from None
    except OSError:
        return  # open() names the cause (permission denied, ...)
    if stat.S_ISDIR(st.st_mode):
        raise PrepareError(f"--input {path} is a folder, not a text file; give the path of the Tiny Shakespeare "
                           f"input.txt")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or other special file"
        raise PrepareError(f"{path} is {kind}, not a text file; give a regular file (it is read whole)")
    if st.st_size > MAX_INPUT_BYTES:
        raise PrepareError(too_large(path, f"{st.st_size:,} bytes"))


def too_large(path, size):
    return (f"{path} holds {size}, more than the {MAX_INPUT_BYTES:,} bytes (1 GiB) this script reads; give a "
            f"smaller text, or tokenise a corpus that large with GPT-2's BPE: data/openwebtext/prepare.py --input")


def read_text(path, download=True):
    """The local file if given or already downloaded, else (download) download it to `path` (as nanoGPT)."""
    # (a link that leads nowhere is not missing: check_input names it; a given --input is never downloaded to,
    # even where os.stat cannot tell, e.g. a name too long for the file system)
    if download and not os.path.lexists(path):
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
    check_input(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_INPUT_BYTES + 1)  # a bounded read even where stat's size is not the truth (/proc)
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text (byte {e.start}); give the Tiny Shakespeare input.txt or "
                           f"convert the file to UTF-8") from e
    except OSError as e:
        raise PrepareError(f"{path}: cannot read it ({e.strerror or e}); give a text file you can read") from e
    if len(text) > MAX_INPUT_BYTES:
        raise PrepareError(too_large(path, f"more than {MAX_INPUT_BYTES:,} characters"))
    if len(text) < 2:  # 90% of fewer than 2 characters leaves train.bin empty, nothing to train on
        what = "holds no text (the file is empty)" if not text else "holds only 1 character, none left for train.bin"
        raise PrepareError(f"{path} {what}; give the Tiny Shakespeare input.txt or another text file")
    return text


def char_ids(text, chars):
    """Each character's id, its index in the sorted vocabulary `chars`, as uint16: the characters as code
    points (UTF-32), looked up ENCODE_CHARS at a time, not as a Python list of ints (8 bytes per character)."""
    points = np.array([ord(c) for c in chars], dtype=np.uint32)  # sorted, as chars is
    ids = np.empty(len(text), dtype=np.uint16)
    for start in range(0, len(text), ENCODE_CHARS):
        chunk = np.frombuffer(text[start:start + ENCODE_CHARS].encode("utf-32-le"), dtype=np.uint32)
        ids[start:start + len(chunk)] = np.searchsorted(points, chunk)
    return ids


def prepare(args):
    if args.input is not None:
        check_input(args.input)  # before anything else: a missing --input is never downloaded to
    check_out_dir(args.out_dir)

    path = args.input or os.path.join(args.out_dir, "input.txt")
    data = read_text(path, download=args.input is None)
    chars = sorted(set(data))
    if len(chars) > MAX_CHARS:
        raise PrepareError(f"{path} has {len(chars):,} distinct characters, more than the {MAX_CHARS:,} ids a token "
                           f"file holds (uint16); tokenise a text that varied with GPT-2's BPE: "
                           f"data/openwebtext/prepare.py --input")
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = len(data)
    ids = char_ids(data, chars)
    train_ids, val_ids = ids[:int(n * 0.9)], ids[int(n * 0.9):]

    with atomic_outputs(args.out_dir, ["train.bin", "val.bin", "meta.pkl", "meta.json"]) as tmp:
        write_array(tmp["train.bin"], train_ids)
        write_array(tmp["val.bin"], val_ids)
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
    p.add_argument("--input", help="a local Tiny Shakespeare input.txt, or another UTF-8 text of at most 1 GiB "
                                   "(default: OUT_DIR/input.txt, downloaded if missing)")
    p.add_argument("--out_dir", default=HERE, help="where train.bin, val.bin, meta.pkl, meta.json go (default: %(default)s)")
    args = p.parse_args()
    with one_line_errors():
        prepare(args)
