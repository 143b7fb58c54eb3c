"""sample.py run as a user runs it (in the repo root, with its command-line arguments) on tiny
checkpoints made here: two commands as subprocesses, the others in this process (runpy), which spares
each of them torch's start-up.

Every output format is parsed back and counted: 3 completions per prompt, and the completions of
markdown, LaTeX and plain text are exactly the ones the JSON lines give for the same seed (LaTeX after
undoing its escapes). Same seed -> same output; a prompt's samples do not depend on the other prompts;
the batched greedy completions equal unbatched greedy generation; NoiseFormer noise on by default
(its own draw per completion) and off on request; bf16 weights give valid samples for every attn_type;
a crafted meta.pkl never runs; bad inputs exit non-zero with a message that names the problem.
"""
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

import gpt2_bpe
from denoised_gpt.checkpoint import read_checkpoint
from helpers import ROOT, run_script_in_process, subprocess_env, tiny_checkpoint, tiny_gpt
from model import ATTENTION_TYPES, GPT, GPTConfig

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

APPENDIX_PROMPTS = "prompts/appendix.txt"  # shipped with the repo, named in the README
# a character vocabulary with every LaTeX / Markdown special character in it
CHARS = sorted(set("\n !$%&#_{}~^\\<>|`*'.,:;?-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
PROMPTS = ["ROMEO:", "50% of $x_1$ & {y} #2 ~^ \\ <a|b> `c`"]
THIRD_PROMPT = "JULIET: O"
NUM_SAMPLES = 3
NEW_TOKENS = 100
# the models here: helpers.TINY_MODEL with a context of 64 and biases, over CHARS by default
SHAPE = dict(block_size=64, vocab_size=len(CHARS), bias=True)


def make_checkpoint(out_dir, attn_type, dataset, **kwargs):
    """A tiny untrained model saved as train.py saves it, at iteration 7 with val loss 3.25 (kwargs:
    tiny_checkpoint's tweak, best_val_loss, vocab_size); returns out_dir."""
    tiny_checkpoint(out_dir, attn_type, dataset, **{**SHAPE, 'best_val_loss': 3.25, **kwargs})
    return out_dir


def loud_noise(model):
    """NoiseFormer noise large enough to change what is sampled, even greedily: the attention output
    (30x its initial scale) decides the next token, and the noise (sigma 3) decides the attention."""
    for block in model.transformer.h:
        block.attn.noise_sigma.fill_(3.0)
        block.attn.c_proj.weight.mul_(30)


def always_endoftext(model):
    """The final hidden state becomes the ln_f bias, which only the <|endoftext|> row of lm_head matches."""
    model.transformer.ln_f.weight.zero_()
    b = torch.randn(model.config.n_embd)
    model.transformer.ln_f.bias.copy_(b)
    model.lm_head.weight[50256] = 10 * b / b.norm()


class CreatesFile:
    """Unpickling this calls open(path, 'w'): the way a crafted pickle runs code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, 'w'))


def crafted_dataset(folder, with_meta_json):
    """A data folder whose meta.pkl would create folder/marker when unpickled. with_meta_json: a
    meta.json that names a char vocabulary without its characters, so the vocabulary comes from meta.pkl."""
    folder.mkdir()
    if with_meta_json:
        (folder / "meta.json").write_text(json.dumps({'vocab_size': len(CHARS), 'tokenizer': 'char'}))
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({'vocab_size': len(CHARS), 'itos': CreatesFile(folder / "marker"), 'stoi': {}}, f)
    return folder


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    data = root / "data-char"
    data.mkdir()
    with open(data / "meta.pkl", "wb") as f:  # nanoGPT's char-level meta.pkl
        pickle.dump({'vocab_size': len(CHARS), 'itos': dict(enumerate(CHARS)),
                     'stoi': {c: i for i, c in enumerate(CHARS)}}, f)
    (root / "prompts.txt").write_text(f"\n{PROMPTS[0]}\n\n   \n{PROMPTS[1]}\n")  # blank lines skipped
    (root / "prompts3.txt").write_text(f"{PROMPTS[0]}\n{PROMPTS[1]}\n{THIRD_PROMPT}\n")  # one prompt added
    evil_pkl = crafted_dataset(root / "evil-pkl", with_meta_json=False)
    evil_json = crafted_dataset(root / "evil-json", with_meta_json=True)
    return {
        'root': root, 'prompts': root / "prompts.txt", 'prompts3': root / "prompts3.txt",
        'evil_pkl': make_checkpoint(root / "out-evil-pkl", "base", evil_pkl),
        'evil_json': make_checkpoint(root / "out-evil-json", "base", evil_json),
        **{attn: make_checkpoint(root / f"out-{attn}", attn, data)
           for attn in ATTENTION_TYPES if attn not in ('base', 'noiseformer_v1')},
        'noisy': make_checkpoint(root / "out-noisy", "noiseformer_v1", data, tweak=loud_noise),
        'base': make_checkpoint(root / "out-base", "base", data),
        # GPT-2's vocabulary and no meta.pkl in its (missing) dataset folder: tiktoken's gpt2 encoding
        'gpt2': make_checkpoint(root / "out-gpt2", "base", root / "no-such-dataset", tweak=always_endoftext,
                                vocab_size=50304, best_val_loss=1e9),
    }


def launch(*args):
    """`python3 sample.py ARGS` started as a subprocess in the repo root (one OpenMP thread)."""
    return subprocess.Popen([sys.executable, "sample.py", *args], cwd=ROOT, env=subprocess_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def runs(ckpts):
    """Every sample.py command of this file, run at once (each is a second or two of start-up)."""
    root, prompts = ckpts['root'], f"--prompts_file={ckpts['prompts']}"
    noisy, base = f"--out_dir={ckpts['noisy']}", f"--out_dir={ckpts['base']}"
    (root / "empty.txt").write_text("\n  \n\n")
    (root / "no-ckpt").mkdir(exist_ok=True)
    commands = {
        'jsonl': [noisy, prompts, "--format=jsonl"],
        'text': [noisy, prompts],
        'markdown': [noisy, prompts, "--format=markdown"],
        'latex': [noisy, prompts, "--format=latex"],
        'noise_off': [noisy, prompts, "--format=jsonl", "--noise_at_eval=False"],
        'noise_flag_on_base': [base, "--noise_at_eval=False"],
        'absurd': [base, "--num_samples=99999999999", "--max_new_tokens=2"],
        'missing': [base, f"--prompts_file={root / 'nope.txt'}"],
        'empty': [base, f"--prompts_file={root / 'empty.txt'}"],
        'no_checkpoint': [f"--out_dir={root / 'no-ckpt'}"],
        'gpt2_eot': [f"--out_dir={ckpts['gpt2']}", "--start=Hello world", "--temperature=0",
                     "--max_new_tokens=3", "--num_samples=1", "--format=latex"],
        'appendix_file': [f"--out_dir={ckpts['gpt2']}", f"--prompts_file={APPENDIX_PROMPTS}", "--temperature=0",
                          "--max_new_tokens=2", "--num_samples=1", "--format=jsonl"],
        # seeding: a prompt added at the end; that prompt alone with the seed its position gives it
        'appended': [noisy, f"--prompts_file={ckpts['prompts3']}", "--format=jsonl"],
        'third_alone': [noisy, f"--start={THIRD_PROMPT}", f"--seed={1337 + 2}", "--format=jsonl"],
        # greedy: the only randomness left is the noise, drawn per completion (and weights in bf16)
        'noisy_greedy': [noisy, prompts, "--format=jsonl", "--temperature=0", "--dtype=bfloat16"],
        'greedy': [base, prompts, "--format=jsonl", "--temperature=0", "--dtype=float32"],
        'greedy_no_cache': [base, prompts, "--format=jsonl", "--temperature=0", "--dtype=float32", "--kv_cache=False"],
        'evil_pkl': [f"--out_dir={ckpts['evil_pkl']}"],
        'evil_json': [f"--out_dir={ckpts['evil_json']}"],
        # noiseformer_v1 in bf16: noisy_greedy
        **{f"bf16_{attn}": [f"--out_dir={ckpts[attn]}", f"--start={PROMPTS[0]}", "--format=jsonl", "--dtype=bfloat16"]
           for attn in ATTENTION_TYPES if attn != 'noiseformer_v1'},
    }
    if gpt2_bpe.unavailable():  # tiktoken's GPT-2 files can be neither found nor downloaded
        del commands['gpt2_eot'], commands['appendix_file']
    # as a user runs it: the reference output (stdout holds only the samples) and the crafted meta.pkl
    procs = {name: launch(*commands.pop(name)) for name in ('jsonl', 'evil_pkl')}
    results = {name: run_script_in_process('sample.py', args) for name, args in commands.items()}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return results


def output(runs, name):
    proc = runs[name]
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def reference(runs):
    """The JSON lines records: every other format must give the same completions."""
    return [json.loads(line) for line in output(runs, 'jsonl').splitlines()]


def completions_by_prompt(records):
    return [[r['completion'] for r in records if r['prompt_index'] == i] for i in range(len(PROMPTS))]


def test_jsonl_three_completions_per_prompt_reproducible(runs, reference):
    records = reference
    again = output(runs, 'appended').splitlines()[:len(records)]  # a second run; its extra prompt comes last
    assert output(runs, 'jsonl').splitlines() == again, "the same seed must give the same samples"
    assert len(records) == len(PROMPTS) * NUM_SAMPLES  # blank lines of the prompts file skipped
    assert [r['prompt'] for r in records] == [p for p in PROMPTS for _ in range(NUM_SAMPLES)]
    for r in records:
        assert len(r['completion']) == NEW_TOKENS  # one character per token
        assert (r['attn_type'], r['iter'], r['best_val_loss'], r['noise_on']) == ("noiseformer_v1", 7, 3.25, True)
    for comps in completions_by_prompt(records):
        assert len(set(comps)) == NUM_SAMPLES, "the samples of a prompt must differ"


def test_text_format_is_nanogpts(runs, reference):
    out = output(runs, 'text')
    blocks = out.split("\n---------------\n")
    assert out.endswith("---------------\n") and len(blocks) == len(PROMPTS) * NUM_SAMPLES + 1
    expected = completions_by_prompt(reference)
    for i, prompt in enumerate(PROMPTS):
        for j in range(NUM_SAMPLES):
            block = blocks[i * NUM_SAMPLES + j]
            if j == 0:  # several prompts: each one's samples start with a header line
                header, block = block.split("\n", 1)
                assert header.startswith(f"=== prompt {i + 1}/{len(PROMPTS)}")
            assert block == prompt + expected[i][j]


def test_markdown_appendix(runs, reference):
    out = output(runs, 'markdown')
    head, *sections = re.split(r"^### ", out, flags=re.M)
    assert out.count("ckpt.pt") == 1 and "noiseformer_v1" in head and "iter 7" in head and "3.2500" in head
    assert len(sections) == len(PROMPTS)
    expected = completions_by_prompt(reference)
    for i, section in enumerate(sections):
        assert section.startswith(f"Prompt {i + 1}: ")
        blocks = re.findall(r"^(`{3,})text\n(.*?)\n\1$", section, flags=re.M | re.S)
        assert [b for _, b in blocks] == expected[i]
        assert len(re.findall(r"^---$", section, flags=re.M)) == NUM_SAMPLES - 1
    # the heading of the second prompt escapes what Markdown would read as markup
    assert sections[1].splitlines()[0] == r"Prompt 2: 50% of $x\_1$ \& {y} \#2 \~^ \\ \<a\|b\> \`c\`"


LATEX_ESCAPES = {r'\textbackslash{}': '\\', r'\textasciicircum{}': '^', r'\textasciitilde{}': '~',
                 r'\textless{}': '<', r'\textgreater{}': '>', r'\textbar{}': '|', r'\mbox{}': '',
                 '\\\\\n': '\n', '~': ' ', **{'\\' + c: c for c in '{}$&#%_'}}


def unlatex(s):
    return re.sub('|'.join(re.escape(k) for k in sorted(LATEX_ESCAPES, key=len, reverse=True)),
                  lambda m: LATEX_ESCAPES[m.group()], s)


def test_latex_appendix(runs, reference):
    out = output(runs, 'latex')
    head, *sections = re.split(r"^\\subsubsection\*", out, flags=re.M)
    assert out.count("ckpt.pt") == 1 and r"noiseformer\_v1" in head and "iter 7" in head
    assert len(sections) == len(PROMPTS)
    expected = completions_by_prompt(reference)
    for i, section in enumerate(sections):
        bodies = re.findall(r"\\begin\{quote\}\n(.*?)\n\\end\{quote\}", section, flags=re.S)
        assert len(bodies) == NUM_SAMPLES
        assert section.count(r"\noindent\rule{\linewidth}{0.4pt}") == NUM_SAMPLES - 1
        for body, text in zip(bodies, expected[i]):
            # nothing LaTeX would interpret is left: only our escapes and line breaks
            assert not re.search(r"[\\{}$&#%_^]", re.sub(r"\\[a-z]+\{\}|\\[{}$&#%_]|\\\\$", "", body, flags=re.M))
            assert unlatex(body) == text
    assert sections[1].startswith(r"{Prompt 2: 50\% of \$x\_1\$ \& \{y\} \#2 \textasciitilde{}\textasciicircum{} "
                                  r"\textbackslash{} \textless{}a\textbar{}b\textgreater{} `c`}")


def test_noise_on_by_default_and_off_on_request(runs, reference):
    off = [json.loads(line) for line in output(runs, 'noise_off').splitlines()]
    assert all(r['noise_on'] for r in reference) and not any(r['noise_on'] for r in off)
    assert completions_by_prompt(off) != completions_by_prompt(reference)
    # every format says so, the plain text one (no header: nanoGPT's output) on stderr
    assert "NoiseFormer attention noise on, as in the paper" in runs['text'].stderr
    assert "noise on" not in runs['noise_off'].stderr


@pytest.mark.parametrize("problem, expected", [
    ("noise_flag_on_base", ["noise_at_eval", "noiseformer", "attn_type='base'"]),
    ("missing", ["prompts_file", "nope.txt", "not found"]),
    ("empty", ["empty.txt", "no prompts", "one prompt per line"]),
    ("no_checkpoint", ["no checkpoint", "ckpt.pt"]),
])
def test_bad_inputs_fail_clearly(runs, problem, expected):
    proc = runs[problem]
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    for words in expected:
        assert words in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_gpt2_vocab_special_tokens_readable(runs):
    """A GPT-2-vocabulary checkpoint (tiktoken, no meta.pkl) that always predicts <|endoftext|>."""
    gpt2_bpe.require()  # tiktoken's GPT-2 files: skipped only when neither cached nor downloadable
    out = output(runs, 'gpt2_eot')
    eot = r"\texttt{\textless{}\textbar{}endoftext\textbar{}\textgreater{}}"
    assert re.search(r"\\begin\{quote\}\n(.*?)\n\\end\{quote\}", out, re.S).group(1) == eot * 3
    assert "Hello world" in out and "best val loss" not in out  # never evaluated: not shown


def records_of(runs, name):
    return [json.loads(line) for line in output(runs, name).splitlines()]


def test_prompt_samples_do_not_depend_on_other_prompts(runs, reference):
    """Prompt i is seeded with seed + i and batched alone: appending a prompt changes no other
    prompt's samples, and the added prompt's samples are those of that prompt alone at seed + 2."""
    appended = records_of(runs, 'appended')
    assert completions_by_prompt(appended) == completions_by_prompt(reference)
    third = [r for r in appended if r['prompt_index'] == 2]
    alone = records_of(runs, 'third_alone')
    assert [r['completion'] for r in third] == [r['completion'] for r in alone]
    assert third[0]['seed'] == alone[0]['seed'] == 1339
    assert len(set(r['completion'] for r in alone)) == NUM_SAMPLES  # the batch's rows are different samples


def unbatched_greedy(out_dir, prompt, use_cache):
    """What the model generates for one sequence at temperature 0 (float32), in this process."""
    checkpoint = read_checkpoint(out_dir, map_location="cpu")[1]
    model = GPT(GPTConfig(**checkpoint['model_args']))
    model.load_state_dict(checkpoint['model'])
    model.eval()
    x = torch.tensor([[CHARS.index(c) for c in prompt]])
    y = model.generate(x, NEW_TOKENS, temperature=0, use_cache=use_cache)
    return ''.join(CHARS[i] for i in y[0, len(prompt):].tolist())


def test_batched_greedy_equals_unbatched_generation(runs, ckpts):
    """temperature=0: every completion of sample.py's batch (KV cache or not) is the model's own
    one-sequence greedy continuation."""
    expected = [unbatched_greedy(ckpts['base'], p, use_cache=True) for p in PROMPTS]
    for name in ('greedy', 'greedy_no_cache'):
        assert completions_by_prompt(records_of(runs, name)) == [[e] * NUM_SAMPLES for e in expected], name


@pytest.mark.parametrize("attn_type, extra", [(a, {}) for a in ATTENTION_TYPES if 'noise_at_eval' not in
                                              ATTENTION_TYPES[a].config_fields] +
                         [('noiseformer_v2', {'noise_at_eval': False})])
def test_generate_batch_rows_equal_single_sequence_greedy(attn_type, extra):
    """What sample.py's batching relies on, for every deterministic variant: row j of a batched greedy
    generation equals the generation of that sequence alone, with and without the cache."""
    model = tiny_gpt(attn_type, **SHAPE, **extra)
    model.eval()
    x = torch.randint(len(CHARS), (1, 5))
    for use_cache in (True, False):
        alone = model.generate(x, 70, temperature=0, use_cache=use_cache)  # 75 > block_size: crops too
        batch = model.generate(x.repeat(3, 1), 70, temperature=0, use_cache=use_cache)
        assert torch.equal(batch, alone.expand(3, -1)), (attn_type, use_cache)


def test_noise_drawn_per_completion(runs):
    """With noise on, the completions of a batch must not share one noise draw: at temperature 0 the
    noise is the only randomness, so a shared draw would make the 3 completions identical."""
    for comps in completions_by_prompt(records_of(runs, 'noisy_greedy')):
        assert len(set(comps)) == NUM_SAMPLES


@pytest.mark.parametrize("attn_type", list(ATTENTION_TYPES))
def test_bf16_weights_sample_valid_tokens(runs, attn_type):
    name = 'noisy_greedy' if attn_type == 'noiseformer_v1' else f"bf16_{attn_type}"
    records = records_of(runs, name)
    assert "weights held in bfloat16" in runs[name].stderr
    assert len(records) >= NUM_SAMPLES
    for r in records:  # NaN/inf logits would stop multinomial; a wrong id would not decode to a character
        assert len(r['completion']) == NEW_TOKENS and set(r['completion']) <= set(CHARS), r['completion']
    assert len(set(r['completion'] for r in records[:NUM_SAMPLES])) == NUM_SAMPLES


@pytest.mark.parametrize('trained_in', ['float32', 'bfloat16'])
def test_auto_dtype_samples_in_the_dtype_the_checkpoint_was_trained_in(ckpts, tmp_path, trained_in):
    """dtype='auto' takes the run's training dtype, as eval.py does: on a CPU with bfloat16, a model trained in
    float32 (config/train_mqar.py) keeps float32 weights, and greedy samples equal --dtype=float32's."""
    from helpers import save_model_checkpoint
    save_model_checkpoint(tmp_path, tiny_gpt('base', **SHAPE),
                          config={'dataset': str(ckpts['root'] / 'data-char'), 'dtype': trained_in})
    args = [f'--out_dir={tmp_path}', f'--start={PROMPTS[0]}', '--device=cpu', '--temperature=0',
            '--num_samples=1', '--max_new_tokens=20', '--format=jsonl']
    auto = run_script_in_process('sample.py', args)
    assert auto.returncode == 0, auto.stderr
    assert f"device cpu ({trained_in})" in auto.stderr
    assert ("weights held in bfloat16" in auto.stderr) == (trained_in == 'bfloat16')
    explicit = run_script_in_process('sample.py', args + [f'--dtype={trained_in}'])
    assert auto.stdout == explicit.stdout and auto.stdout.strip()


@pytest.mark.parametrize("name", ['evil_pkl', 'evil_json'])
def test_crafted_meta_pkl_refused_never_run(runs, ckpts, name):
    """A clean checkpoint whose config['dataset'] points (outside data/) at a folder with a meta.pkl
    that would create a file when unpickled: exit 2, one clear error line, no file created."""
    folder = ckpts['root'] / name.replace('_', '-')
    proc = runs[name]
    assert not (folder / "marker").exists(), "the crafted meta.pkl was unpickled with plain pickle"
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("sample.py: error:")]
    assert len(errors) == 1 and "meta.pkl" in errors[0] and "plain-data" in errors[0], proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and str(folder.resolve()) in notes[0] and "outside data/" in notes[0]


def test_readme_sampling_example_prompts_file_exists(runs):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Sampling", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"--prompts_file=(\S+)", section)
    assert named == ['prompts/shakespeare_char.txt', APPENDIX_PROMPTS], named
    assert all((ROOT / name).is_file() for name in named)
    prompts = [line for line in (ROOT / APPENDIX_PROMPTS).read_text().splitlines() if line.strip()]
    assert len(prompts) >= 3
    assert f"--prompts_file={APPENDIX_PROMPTS}" in (ROOT / "sample.py").read_text()  # the docstring's example
    if 'appendix_file' in runs:  # and sample.py reads it: one record per prompt, in order
        assert [r['prompt'] for r in records_of(runs, 'appendix_file')] == prompts


def test_char_prompts_file_fits_the_quickstart_vocabulary():
    """prompts/shakespeare_char.txt, the README's appendix prompts for the quickstart model, uses only
    characters that data/shakespeare_char/prepare.py puts in its vocabulary (every character of the text)."""
    text = os.environ.get('TINY_SHAKESPEARE')
    if not text or not os.path.isfile(text):
        pytest.skip('set TINY_SHAKESPEARE to Tiny Shakespeare\'s input.txt (CI does) to check its vocabulary')
    vocabulary = set(open(text, encoding='utf-8').read())
    prompts = [line for line in (ROOT / 'prompts' / 'shakespeare_char.txt').read_text().splitlines() if line.strip()]
    assert len(prompts) >= 3 and all(set(p) <= vocabulary for p in prompts)
    assert not set((ROOT / 'prompts' / 'appendix.txt').read_text()) <= vocabulary  # why the char set exists


def test_a_nonfinite_checkpoint_is_one_line(ckpts, tmp_path):
    """A diverged run's weights (made elsewhere: train.py never saves them) used to end in torch.multinomial's
    RuntimeError ('probability tensor contains either inf, nan or element < 0')."""
    def nan_weight(model):
        model.transformer.h[1].attn.c_proj.weight[3, 5] = float('nan')

    out = make_checkpoint(tmp_path / 'out', 'base', ckpts['root'] / 'data-char', tweak=nan_weight)
    proc = run_script_in_process('sample.py', [f'--out_dir={out}', f'--start={PROMPTS[0]}'])
    assert proc.returncode == 2 and proc.stdout == ''
    assert proc.stderr.strip().splitlines() == [f"sample.py: error: {out / 'ckpt.pt'} holds non-finite weights (NaN "
                                                f"or inf), the state of a run that diverged: every loss and sample "
                                                f"from it would be NaN. Use an earlier checkpoint (ckpt.prev.pt next "
                                                f"to it, if finite), or train again with a lower learning_rate"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists('/dev/full'), reason="needs /dev/full (every write: ENOSPC)")
def test_a_stdout_that_cannot_take_the_samples_is_one_line(ckpts):
    """`sample.py > /dev/full`: a full disk behind stdout was an OSError traceback."""
    with open('/dev/full', 'w') as full:
        proc = subprocess.run([sys.executable, "sample.py", f"--out_dir={ckpts['base']}", "--num_samples=1",
                               "--max_new_tokens=4"], cwd=ROOT, env=subprocess_env(), text=True, stdout=full,
                              stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("sample.py: error: cannot write the results to /dev/full: no "
                                                    "space left on device; free some space and run it again")
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_a_prompts_file_that_is_no_text_file_is_one_line_before_anything_loads(tmp_path):
    """--prompts_file (and --start=FILE:) read at most 16 MiB, and nothing that is not a regular file: /dev/zero
    never ends, a FIFO waits for a writer for ever, a huge (here sparse) file would be held whole."""
    from denoised_gpt.files import MAX_PROMPT_BYTES
    fifo = tmp_path / 'fifo'
    os.mkfifo(fifo)
    huge = tmp_path / 'huge.txt'
    with open(huge, 'wb') as f:
        f.truncate(MAX_PROMPT_BYTES + 1)
    (tmp_path / 'latin1.txt').write_bytes('caf\xe9\n'.encode('latin-1'))
    cases = [('--prompts_file=/dev/zero', "it is a device, not a file"), (f'--prompts_file={fifo}', "it is a FIFO"),
             (f'--prompts_file={huge}', "is larger than 16 MiB"), (f'--start=FILE:{huge}', "is larger than 16 MiB"),
             (f"--prompts_file={tmp_path / 'latin1.txt'}", "is not UTF-8 text")]
    for arg, message in cases:
        proc = run_script_in_process('sample.py', [f"--out_dir={tmp_path / 'no-run'}", arg])
        assert proc.returncode == 2 and message in proc.stderr, (arg, proc.stderr)
        assert proc.stderr.count('\n') == 1 and proc.stderr.startswith('sample.py: error: ')


@pytest.mark.parametrize('arg, message', [
    (f'--num_samples={2**70}', "num_samples=118059162071... (22 digits) is over the limit of 9,223,372,036,854,775,807 "
                               "completions per prompt (torch's int64)"),  # (a TypeError's C++ stack)
    (f'--max_new_tokens={10**40}', "max_new_tokens=100000000000... (41 digits) is over the limit of 1,000,000 "
                                   "tokens"),  # (generated for ever)
])
def test_counts_past_any_real_use_are_one_line_before_anything_loads(tmp_path, arg, message):
    proc = run_script_in_process('sample.py', [f"--out_dir={tmp_path / 'no-run'}", arg])
    assert proc.returncode == 2 and proc.stderr == f"sample.py: error: {message}\n", proc.stderr


def test_more_samples_than_memory_holds_is_one_line(runs):
    proc = runs['absurd']
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sample.py: error: cannot generate num_samples=99999999999 x max_new_tokens=2 tokens "
                           "at once: ") and last.endswith("; ask for fewer")
