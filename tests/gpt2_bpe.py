"""Whether tiktoken can load GPT-2's BPE here, for the tests that need it (data preparation, GLUE,
sampling and lm-eval with GPT-2's vocabulary).

tiktoken finds the files the way the README says: in TIKTOKEN_CACHE_DIR, in its default cache, or
by a one-time download (which it then caches). Only when none of those works are such tests
skipped, with the reason and how to supply the files."""
import functools
import threading

import pytest
import tiktoken
import tiktoken.load

from denoised_gpt.hf_format import GPT2_BPE_FILES

# the two files of tiktoken's 'gpt2' encoding: where tiktoken fetches them from (its cache is keyed by
# these addresses) and their SHA-256, as export_hf.py reads them
_GPT2_FILES = GPT2_BPE_FILES


@functools.lru_cache(maxsize=None)
def unavailable():
    """None when the 'gpt2' and 'r50k_base' encodings load (prepare.py uses r50k_base), else why not."""
    outcome = []

    def load():
        try:
            for name in ("gpt2", "r50k_base"):
                tiktoken.get_encoding(name)
            outcome.append(None)
        except Exception as e:  # requests' connection errors and friends
            outcome.append(f"{type(e).__name__}: {e}"[:300])

    # tiktoken downloads with no timeout: a network that drops packets would hang the whole suite
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=60)
    return outcome[0] if outcome else "the download did not finish in 60 s"


def skip_message(why):
    return (f"the GPT-2 BPE files are neither cached nor downloadable ({why}). To run these tests "
            f"offline, set TIKTOKEN_CACHE_DIR to a folder holding them: a copy of a tiktoken cache from a "
            f"machine with network ($TMPDIR/data-gym-cache, or that machine's TIKTOKEN_CACHE_DIR)")


def require():
    """Skip the calling test when the BPE files cannot be loaded."""
    why = unavailable()
    if why:
        pytest.skip(skip_message(why))


def gpt2_file(name):
    """The bytes of GPT-2's 'encoder.json' or 'vocab.bpe' (what transformers calls vocab.json and
    merges.txt), read as tiktoken reads them: from its cache, which require() has filled (or, with
    caching turned off by an empty TIKTOKEN_CACHE_DIR, fetched again). Skips like require()."""
    require()
    url, sha256 = _GPT2_FILES[name]
    return tiktoken.load.read_file_cached(url, sha256)
