"""bench.py on a tiny model: what it prints and writes, not how fast it is. The run of every variant is a
subprocess, as a user runs it (its stderr is the process's: torch.profiler's native code writes there);
the others run in this process (run_script_in_process), which spares each a torch start-up."""
import contextlib
import dataclasses
import io
import json
import os
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import ROOT, run_script_in_process, subprocess_env
from model import ATTENTION_TYPES, GPT, GPTConfig

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2", "--vocab_size=96",
        "--warmup_iters=1", "--bench_iters=2", "--rounds=1"]


def bench(*args, size=TINY):
    """`python3 bench.py` on the tiny model (or `size`'s settings), with args, in this process (one thread,
    as subprocess_env's OMP_NUM_THREADS=1)."""
    return run_script_in_process("bench.py", [*size, *args])


def table_rows(stdout, marker):
    """{first column: other columns} of the table whose header line contains `marker`."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line) + 1
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        name, *cells = line.split()
        rows[name] = cells
    return rows


@pytest.fixture(scope="module")
def all_variants(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run([sys.executable, "bench.py", *TINY, "--attn_types=all", "--generate=True",
                           "--max_new_tokens=8", f"--json_out={out}"], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text()), proc.stderr


def test_no_profiler_chatter_on_stderr(all_variants):
    """The CPU memory figure comes from torch.profiler, whose native code announces every start and stop."""
    stderr = all_variants[2]
    assert 'profiler_start' not in stderr and 'profiler_stop' not in stderr and 'USDT' not in stderr, stderr


def test_table_has_every_variant_and_base_ratio_one(all_variants):
    stdout, _, _ = all_variants
    rows = table_rows(stdout, "vs base")
    assert list(rows) == list(ATTENTION_TYPES)
    assert "vs eager" not in stdout  # nothing compiled: no column that would read 1.00x everywhere
    for name, (compiled, params, ms, tokens_s, mfu, mem, mem_unit, first, ratio) in rows.items():
        assert compiled == "no"  # compile='auto' on CPU
        assert params.endswith("M") and float(ms) > 0 and int(tokens_s.replace(",", "")) > 0
        assert mfu.endswith("%") and 0 < float(mfu[:-1]) < 100
        assert mem_unit in ("MiB", "GiB") and float(mem) > 0
        assert first.endswith("s") and float(first[:-1]) >= 0
        assert re.fullmatch(r"\d+\.\d\dx", ratio)
    assert rows['base'][-1] == "1.00x"
    assert "model (size as given): n_layer 2, n_head 2, n_embd 32, block_size 32" in stdout
    # progress: a line per variant as it finishes, in running order
    done = re.findall(r"^  round 1/1, (\d+)/(\d+) (\w+): \d+\.\d ms/iter", stdout, re.M)
    assert done == [(str(i + 1), str(len(ATTENTION_TYPES)), a) for i, a in enumerate(ATTENTION_TYPES)]
    assert "peak memory: tensors: parameters + optimizer state + one step" in stdout and re.search(r"measured (bfloat16|float32) matmul", stdout)
    gen = table_rows(stdout, "KV cache tok/s")
    assert list(gen) == list(ATTENTION_TYPES)
    assert all(float(c) > 0 and float(n) > 0 and s.endswith("x") for c, n, s in gen.values())


def test_json_report(all_variants):
    stdout, report, _ = all_variants
    for key in ("device", "device_name", "dtype", "torch", "peak_flops", "peak_flops_source", "memory_method",
                "tokens_per_iter", "command", "config", "results"):
        assert key in report, key
    assert report["device"] == "cpu" and report["peak_flops"] > 0 and report["tokens_per_iter"] == 64
    assert report["config"]["n_embd"] == 32 and report["command"].startswith("python bench.py")
    results = {r["attn_type"]: r for r in report["results"]}
    assert list(results) == list(ATTENTION_TYPES)
    assert results["base"]["ratio_to_base"] == 1.0
    for r in results.values():
        assert r["ms_per_iter"] >= r["ms_per_iter_min"] > 0 and r["first_step_s"] > 0
        assert r["compile"] is False and r["fused_loss"] is True and r["ratio_to_eager"] == 1.0
        assert r["tokens_per_s"] == pytest.approx(64 / (r["ms_per_iter"] / 1000))
        assert r["ratio_to_base"] == pytest.approx(r["ms_per_iter"] / results["base"]["ms_per_iter"])
        assert 0 < r["mfu"] < 1 and r["params"] > 0
        # at least the float32 weights and AdamW's two moments of every non-embedding parameter
        assert r["peak_memory_bytes"] >= 3 * 4 * r["params"]
        assert r["gen_tokens_per_s_cache"] > 0 and r["gen_tokens_per_s_no_cache"] > 0
        assert r["gen_cache_speedup"] == pytest.approx(r["gen_tokens_per_s_cache"] / r["gen_tokens_per_s_no_cache"])
        # the table shows the same numbers
        assert f"{r['ms_per_iter']:.1f}" in stdout
    # each variant's count is its own model's, built from the report's settings (they differ between variants)
    settings = {f.name: report["config"][f.name] for f in dataclasses.fields(GPTConfig) if f.name in report["config"]}
    with torch.device("meta"):
        assert {a: r["params"] for a, r in results.items()} == \
            {a: GPT(GPTConfig(**{**settings, "attn_type": a})).get_num_params() for a in ATTENTION_TYPES}
    assert len({r["params"] for r in results.values()}) > 1


def test_real_data_float32_plain_loss_subset_without_base(tmp_path):
    data = tmp_path / "tiny"
    data.mkdir()
    np.random.default_rng(0).integers(0, 50, 4096, dtype=np.uint16).tofile(data / "train.bin")
    (data / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 50}))
    proc = bench("--attn_types=diff, linear", f"--dataset={data}", "--dtype=float32", "--fused_loss=False")
    assert proc.returncode == 0, proc.stderr
    assert str(data) in proc.stdout and "vocab_size 50" in proc.stdout and "(float32)" in proc.stdout
    assert "step: lm_head + F.cross_entropy, eager (compile='auto')" in proc.stdout
    rows = table_rows(proc.stdout, "vs base")
    assert list(rows) == ["diff", "linear"] and all(cells[-1] == "-" for cells in rows.values())
    assert "add base to --attn_types" in proc.stdout


def test_wider_query_key_heads(tmp_path):
    """--qk_head_size (what grow.py widens) builds base and symmetric with 24-wide q/k heads on 16-wide
    value heads: the parameter counts are those models' own."""
    from model import GPT, GPTConfig
    proc = bench("--attn_types=base,symmetric", "--qk_head_size=24", f"--json_out={tmp_path / 'b.json'}")
    assert proc.returncode == 0, proc.stderr
    results = {r["attn_type"]: r for r in json.loads((tmp_path / "b.json").read_text())["results"]}
    for attn_type, r in results.items():
        config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=96, bias=False,
                           attn_type=attn_type, qk_head_size=24)
        assert r["params"] == GPT(config).get_num_params()
    assert results["base"]["params"] - results["symmetric"]["params"] == 2 * 32 * 2 * 24  # per layer: W_K


@pytest.mark.parametrize("args, words", [
    (["--attn_types=base,difff"], ["'difff'", "dint_lowrank", "all"]),
    (["--attn_types=base,diff", "--qk_head_size=24"], ["qk_head_size=24", "attn_type='diff'"]),
    (["--bench_iters=0"], ["bench_iters", "at least 1"]),
    (["--warmup_iters=0"], ["warmup_iters", "at least 1"]),
    (["--compile=yes"], ["compile='yes'", "--compile=True, --compile=False or --compile=auto"]),
    pytest.param(["--device=cuda"], ["cuda", "--device=cpu"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_settings_fail_clearly(args, words):
    proc = bench(*args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_cpu_default_size_and_rounds():
    """No size key given: on CPU the 4-layer 256-wide model at batch 8, block 256 (GPT-2 small takes
    minutes per step there), three rounds by default, and the first line says which size ran."""
    proc = bench("--attn_types=base", "--warmup_iters=1", "--bench_iters=1", size=["--vocab_size=96"])
    assert proc.returncode == 0, proc.stderr
    assert ("model (the default size on cpu): n_layer 4, n_head 4, n_embd 256, block_size 256, vocab_size 96, "
            "bias False; batch_size 8 (2,048 tokens/iter)") in proc.stdout
    assert re.findall(r"^  round (\d)/3, 1/1 base: ", proc.stdout, re.M) == ["1", "2", "3"]


def test_a_given_size_key_keeps_the_other_cpu_defaults():
    proc = bench("--attn_types=base", "--rounds=1", "--warmup_iters=1", "--bench_iters=1",
                 size=["--vocab_size=96", "--n_layer=1"])
    assert proc.returncode == 0, proc.stderr
    assert "model (size as given): n_layer 1, n_head 4, n_embd 256, block_size 256" in proc.stdout


@pytest.mark.skipif(not os.environ.get('INDUCTOR_TESTS'), reason="inductor's cold compile takes 30-90 s on "
                    "2 cores; INDUCTOR_TESTS=1 runs this test")
def test_compile_both_times_eager_and_compiled():
    proc = bench("--attn_types=base", "--compile=both", "--rounds=1", "--dtype=float32")
    assert proc.returncode == 0, proc.stderr
    assert "eager and compiled (compile='both')" in proc.stdout
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("base ")]
    assert [cells[1] for cells in lines] == ["no", "yes"]
    eager_first, compiled_first = (float(cells[8][:-1]) for cells in lines)
    assert compiled_first > eager_first  # the cold compile is in the compiled run's first step
    assert lines[0][-1] == "1.00x" and re.fullmatch(r"\d+\.\d\dx", lines[1][-1])


def test_memory_plan(tmp_path):
    """--plan=True: arithmetic only, no device and no timing; a row per attn_type x (ddp, fsdp) x checkpointing,
    and a row saying why a size cannot be built (diff needs an even head count)."""
    out = tmp_path / "plan.json"
    proc = bench("--plan=True", "--attn_types=base,diff", "--plan_world_size=4", f"--json_out={out}",
                 size=["--n_layer=2", "--n_head=3", "--n_embd=48"])
    assert proc.returncode == 0, proc.stderr
    assert "fsdp over 4 GPUs" in proc.stdout and "ms/iter" not in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("2/48/3 ")]
    assert [r[1:4] for r in rows if r[1] == "base"] == [["base", "ddp", "off"], ["base", "ddp", "on"],
                                                         ["base", "fsdp", "off"], ["base", "fsdp", "on"]]
    assert [r[1:3] for r in rows if r[1] == "diff"] == [["diff", "n/a:"]]
    report = json.loads(out.read_text())
    ddp, fsdp = (r for r in report["rows"] if r["attn_type"] == "base" and not r.get("checkpointing"))
    assert report["world_size"] == 4 and ddp["param_bytes"] == 4 * fsdp["param_bytes"] == 4 * ddp["params"]


def test_a_dataset_path_without_token_files_fails_in_one_line_with_a_hint_that_works(tmp_path):
    """An absolute --dataset: the hint names that folder as it is (no 'data//abs/path/prepare.py')."""
    proc = bench("--attn_types=base", f"--dataset={tmp_path}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"bench.py: error: {tmp_path / 'train.bin'} not found: "), lines
    assert f"{tmp_path} needs the train.bin and val.bin" in lines[0] and "data//" not in lines[0]
    assert lines[0].endswith("; or leave --dataset empty for synthetic tokens")


def test_rounds_that_disagree_are_called_so(tmp_path):
    """Two rounds: each run's round medians and their spread are in the JSON, and the console says whether
    the rounds agree, by that spread (a warning past 25 % of the median, naming the worst run)."""
    out = tmp_path / "b.json"
    proc = bench("--attn_types=base,diff", "--rounds=2", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    for r in results:
        assert len(r["round_ms"]) == 2
        assert r["round_spread"] == pytest.approx((max(r["round_ms"]) - min(r["round_ms"])) / r["ms_per_iter"])
    assert re.search(r"round 1 took \d+ s: 1 more to go, about \d+ s", proc.stdout)
    # the whole run's length as soon as its first variant has a time, before the second starts
    first, estimate, second = (proc.stdout.index(s) for s in ("1/2 base: ", "the whole benchmark: ", "2/2 diff: "))
    assert first < estimate < second
    assert re.search(r"the whole benchmark: about \d+s \(2 run\(s\) x 2 round\(s\) at base's \d+ s;", proc.stdout)
    if any(r["round_spread"] > 0.25 for r in results):
        worst = max(results, key=lambda r: r["round_spread"])
        assert f"warning: the rounds disagree: {worst['attn_type']} took " in proc.stdout
    else:
        assert "the rounds agree: every run's round medians within 25% of its median" in proc.stdout


@pytest.mark.parametrize("args, phrase", [
    (["--block_size=100000000000"], "block_size=100000000000 is too large: one training step at batch_size=2, "
                                    "block_size=100000000000, n_layer=2, n_embd=32, vocab_size=96 would need at least "
                                    "96.0 TiB, more than the "),
    (["--vocab_size=9223372036854775808"], "vocab_size=9223372036854775808 is too large: one training step at "),
    (["--plan=True", "--n_embd=99999999999", "--n_head=1"],
     "n_embd=99999999999 is too large: the weights, gradients and AdamW state per GPU (16 bytes a parameter, sharded "
     "over plan_world_size=8 GPUs) at n_layer=2, n_embd=99999999999, block_size=32, vocab_size=96 would need at "
     "least "),
])
def test_sizes_no_machine_holds_are_refused_up_front_in_one_line(args, phrase):
    """A size setting far past the machine's memory: one line naming it and the memory one step (or, planned, one
    GPU) would need, before anything is allocated (it was the allocator's traceback, or an overflow in the plan's
    model on the meta device)."""
    proc = bench("--attn_types=base", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.py: error: " + phrase), lines
    assert lines[0].endswith(f"; choose a smaller {phrase.split('=')[0]}" +
                             (" or a larger plan_world_size" if "--plan=True" in args else ""))
    assert "round 1" not in proc.stdout


@pytest.mark.parametrize("key", ["warmup_iters", "bench_iters", "rounds"])
def test_counts_that_would_run_for_ever_are_refused_in_one_line(key):
    """warmup_iters=10**40 was accepted, and ran for ever."""
    proc = bench("--attn_types=base", f"--{key}={10**40}")
    assert proc.returncode == 2 and "round 1" not in proc.stdout
    assert proc.stderr.strip() == f"bench.py: error: {key}=100000000000... (41 digits) is over the limit of " \
                                  f"1,000,000 {'rounds' if key == 'rounds' else 'steps'}"


def bench_into(stdout, *args):
    """bench() with stdout going to the file object `stdout` (a real one: its writes may fail) instead of a
    buffer: (exit status, stderr)."""
    err = io.StringIO()
    saved = sys.argv, os.getcwd(), torch.get_num_threads()
    sys.argv = ["bench.py", *TINY, *args]
    os.chdir(ROOT)
    torch.set_num_threads(1)
    rc = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / "bench.py"), run_name="__main__")
    except SystemExit as e:
        rc = e.code
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
        torch.set_num_threads(saved[2])
    return rc, err.getvalue()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_results_that_cannot_be_written_end_in_one_line_and_keep_the_previous_file(tmp_path):
    """A full disk: stdout on it, or the JSON results file. Each was a traceback (open(json_out, 'w') also
    emptied the results of an earlier run before failing); now one line, exit 1, and the earlier file as it was.
    The JSON goes through json_out + '.tmp', here a link to /dev/full: every write to it fails with ENOSPC."""
    with open("/dev/full", "w") as full:  # (the plan: the first line printed fails, as any would)
        rc, err = bench_into(full, "--plan=True", "--attn_types=base")
    assert rc == 1 and err == ("bench.py: error: cannot write the results to /dev/full: no space left on device; "
                               "free some space and run it again\n")
    out = tmp_path / "b.json"
    out.write_text('{"earlier": "results"}')
    (tmp_path / "b.json.tmp").symlink_to("/dev/full")
    proc = bench("--plan=True", "--attn_types=base", f"--json_out={out}")  # (written as the benchmark's results are)
    assert proc.returncode == 1 and " base " in proc.stdout  # the table was printed before
    assert proc.stderr == (f"bench.py: error: cannot write {out}: no space left on device; the file there before is "
                           f"intact. Free some space, then run bench.py again (the results above are complete)\n")
    assert out.read_text() == '{"earlier": "results"}' and os.listdir(tmp_path) == ["b.json"]


def test_a_json_out_that_cannot_be_written_is_refused_before_the_benchmark(tmp_path):
    """It was found only when the results were ready, in a traceback (FileNotFoundError, IsADirectoryError)."""
    for json_out, phrase in [(tmp_path / "missing" / "b.json", f"its folder {tmp_path / 'missing'} does not exist"),
                             (tmp_path, "is a folder; name a file in it")]:
        proc = bench("--attn_types=base", f"--json_out={json_out}")
        assert proc.returncode == 2 and proc.stderr.startswith(f"bench.py: error: json_out='{json_out}'")
        assert phrase in proc.stderr and len(proc.stderr.splitlines()) == 1 and "round 1" not in proc.stdout
