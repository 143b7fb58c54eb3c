"""Whether tiktoken can load GPT-2's BPE here, for the tests that need it (data preparation, GLUE).

It loads from TIKTOKEN_CACHE_DIR (conftest points it at a copy of ../shared/tiktoken when there is
one), tiktoken's default cache, or a download. Only when none of those works are such tests
skipped, with the reason and how to supply the files."""
import functools
import threading

import pytest
import tiktoken


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
            f"offline, set TIKTOKEN_CACHE_DIR to a folder holding them: a copy of the project's "
            f"../shared/tiktoken, or of a tiktoken cache from a machine with network ($TMPDIR/data-gym-cache)")


def require():
    """Skip the calling test when the BPE files cannot be loaded."""
    why = unavailable()
    if why:
        pytest.skip(skip_message(why))
