"""
Export a trained checkpoint to the Hugging Face format: a folder that transformers loads, that
`hf upload` publishes (huggingface-cli upload before huggingface_hub 1.0), and that train.py / sample.py /
eval.py take as --init_from.

$ python3 export_hf.py --out_dir=out-owt-noiseformer_v2 --hf_dir=hf-owt-noiseformer_v2
$ python3 export_hf.py --out_dir=out-shakespeare-char/ckpt.prev.pt --hf_dir=hf-shakespeare-char
$ hf upload <user>/<repo> hf-owt-noiseformer_v2

A `base` model with biases becomes a plain transformers GPT2LMHeadModel (no remote code); every other
model carries its own code (model.py and two short wrapper files) and loads with
AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True). The vocabulary keeps the
checkpoint's size, so the logits are exactly the model's. The tokenizer follows the dataset: GPT-2's BPE
(from tiktoken's files), one token per character for char-level data, none for token-id datasets.
README.md in the folder (the model card) records the run and what to know when loading it.
The files are written into a temporary folder beside hf_dir and moved in when all are written, so a
failed export leaves hf_dir as it was. Exporting into an earlier export (--overwrite=True, e.g. into a
git clone of the published model) replaces the export's own files and removes those it no longer
writes; everything else there stays (.git, .gitattributes, your own files and folders). A clone of a
new Hub repository (hidden files only) needs no --overwrite; with the Hub's starting README.md, it does.
"""

from configurator import answer_help

answer_help(__file__)  # --help before the heavy imports below

import os

from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, read_checkpoint
from denoised_gpt.cli import fail, log, read_config
from denoised_gpt.extras import require as require_extra
from denoised_gpt.files import lock_folder, write_problem
from denoised_gpt.hf_format import check_hf_dir, export
from denoised_gpt.weights import refuse_nonfinite_state

# -----------------------------------------------------------------------------
out_dir = 'out'  # the run directory holding ckpt.pt, or a checkpoint file
hf_dir = ''  # the folder to write (default: hf-<run name>, e.g. out-owt-dint -> hf-owt-dint)
dataset = ''  # the data/ folder whose vocabulary the tokenizer is built from (default: the checkpoint's dataset)
overwrite = False  # replace an earlier export in hf_dir: its files only (.git and your own files stay)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]

globals().update(read_config(__file__, {k: globals()[k] for k in config_keys}))
if not hf_dir:
    run_dir = os.path.dirname(checkpoint_path(out_dir)) or '.'
    hf_dir = 'hf-' + os.path.basename(os.path.abspath(run_dir)).removeprefix('out-')
if dataset and not os.path.isdir(os.path.join('data', dataset)):
    fail(f"dataset={dataset!r}: no folder {os.path.join('data', dataset)}; pass the data folder the model was "
         f"trained on (a name under data/, or a path), or leave dataset out to use the checkpoint's")
try:
    require_extra('transformers', "export_hf.py")
    # one export at a time into a folder (a folder that is not there yet: its creation is one rename, and only
    # one rename can make it)
    hf_lock = lock_folder(hf_dir, f"hf_dir={hf_dir!r} is in use by another export_hf.py: one export writes to a "
                                  f"folder at a time. Wait for it to finish, or choose another --hf_dir"
                          ) if os.path.isdir(hf_dir) else None
    check_hf_dir(hf_dir, overwrite)  # before the checkpoint is read
    path, checkpoint = read_checkpoint(out_dir, map_location='cpu', model_only=True)
    refuse_nonfinite_state(checkpoint, path, weights_only=True)
except (ValueError, FileNotFoundError, CheckpointError) as e:
    fail(e)

run_dataset = dataset or checkpoint.get('config', {}).get('dataset')
data_dir = os.path.join('data', run_dataset) if run_dataset else None
if data_dir and not os.path.isdir(data_dir):
    log(f"note: {data_dir} (the model's dataset) is not here, so its vocabulary is unknown; pass "
        f"--dataset=<data folder> if it lies elsewhere")
try:
    notes = export(checkpoint, hf_dir, data_dir, overwrite)
except ValueError as e:
    fail(e)
except OSError as e:  # disk full, no permission: the temporary folder is gone, hf_dir as it was
    cause, remedy = write_problem(e)
    fail(f"cannot write {hf_dir}: {cause}; nothing was changed there. {remedy.capitalize()} and export again")
for note in notes:
    log(note)
print(f"wrote {hf_dir}: load it with transformers (see {os.path.join(hf_dir, 'README.md')}), publish it with "
      f"`hf upload <user>/<repo> {hf_dir}`, or start from it with --init_from={hf_dir}")
