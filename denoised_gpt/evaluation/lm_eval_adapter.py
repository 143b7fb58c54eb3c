"""
EleutherAI's lm-evaluation-harness for our checkpoints: NanoGPTLM implements the harness's LM
interface (loglikelihood, loglikelihood_rolling, generate_until) on top of GPT, so
`lm_eval.simple_evaluate` runs any of its tasks (hellaswag, lambada_openai, arc_easy, piqa, ...) and
scores them with its own code: no task is re-implemented here.

Conventions follow the harness's `hf` model (lm_eval/models/huggingface.py), so scores compare with
published GPT-2 numbers: GPT-2 BPE via tiktoken; context and continuation are tokenized together and
split (TemplateLM._encode_pair); an empty context is replaced by <|endoftext|>; a sequence longer than
block_size is cut on the left, keeping the continuation and the most recent context; rolling
loglikelihoods use the harness's disjoint block_size windows; generation is greedy unless the task asks
for sampling, stops at the task's stop strings or <|endoftext|>, keeps block_size - max_gen_toks tokens
of context, and decodes with the KV cache (model.KVCache), one request at a time.
Loglikelihood requests are batched, longest first, padded on the right (a causal model never looks
at padding), and only the continuation positions go through lm_head.
"""
import difflib

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from denoised_gpt.evaluation import final_hidden_states
from model import KVCache


class NanoGPTLM(TemplateLM):
    """lm-eval's LM interface for a GPT of model.py (any attn_type) with GPT-2's tokenizer."""

    def __init__(self, model, enc, device, ctx, batch_size=8, max_gen_toks=256):
        super().__init__()
        self.model, self.enc, self.ctx = model, enc, ctx
        self._device = device  # LM.device reads it
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.block_size = model.config.block_size

    @property
    def eot_token_id(self):
        return self.enc.eot_token

    @property
    def max_length(self):
        return self.block_size

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.enc.encode(string, allowed_special='all')  # '<|endoftext|>' in a prompt is the token, as in hf

    def tok_decode(self, tokens, **kwargs):
        return self.enc.decode(tokens)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """[(key, context ids, continuation ids)] -> [(sum of continuation log-probs, is greedy)]."""
        results = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc='loglikelihood batches', disable=disable_tqdm, dynamic_ncols=True):
            rows = []
            for i in batch:
                _, context, continuation = requests[i]
                inp = (context + continuation)[-(self.block_size + 1):][:-1]  # left-truncated, as hf
                n_cont = min(len(continuation), len(inp))
                rows.append((inp, continuation[len(continuation) - n_cont:]))
            idx = torch.zeros(len(rows), max(len(inp) for inp, _ in rows), dtype=torch.long)
            for r, (inp, _) in enumerate(rows):
                idx[r, :len(inp)] = torch.tensor(inp)
            with self.ctx:
                hidden = final_hidden_states(self.model, idx.to(self.device))
                for r, (i, (inp, cont)) in enumerate(zip(batch, rows)):
                    # the logits at positions len(inp)-n .. len(inp)-1 predict the n continuation tokens
                    logits = self.model.lm_head(hidden[r, len(inp) - len(cont):len(inp)])
                    logp = F.log_softmax(logits.float(), dim=-1)
                    target = torch.tensor(cont, device=logp.device)
                    results[i] = (logp.gather(-1, target[:, None]).sum().item(),
                                  bool((logp.argmax(-1) == target).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Whole-text log-likelihoods (perplexity tasks) in the harness's disjoint block_size windows."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for w in get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.eot_token_id,
                                               max_seq_len=self.block_size, context_len=1):
                context, continuation = make_disjoint_window(w)
                windows.append((None, context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[n] += ll
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        eos = self.tok_decode([self.eot_token_id])
        out = []
        for req in tqdm(requests, desc='generate_until', disable=disable_tqdm, dynamic_ncols=True):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop('until', None), eos=eos)
            max_gen = kwargs.pop('max_gen_toks')
            if max_gen >= self.block_size:
                raise ValueError(f"a task asks for {max_gen} generated tokens but block_size is {self.block_size}: "
                                 f"lower --max_gen_toks")
            temperature = kwargs.get('temperature', 0.0) if kwargs.get('do_sample') else 0.0
            ids = self.tok_encode(context)[-(self.block_size - max_gen):]
            text = self.tok_decode(self.generate(ids, max_gen, temperature, until))
            out.append(postprocess_generated_text(text, until, None))
        return out

    def generate(self, ids, max_new_tokens, temperature, until):
        """New token ids after ids, with the KV cache, stopping once a stop string appears."""
        model = self.model
        cache = KVCache(model.config.n_layer)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        new = []
        for _ in range(max_new_tokens):
            with self.ctx:
                logits, _ = model(x, kv_cache=cache)
            logits = logits[0, -1].float()
            if temperature > 0:
                token = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1).item()
            else:
                token = int(logits.argmax())
            new.append(token)
            if token == self.eot_token_id or any(s and s in self.tok_decode(new) for s in until):
                break
            x = torch.tensor([[token]], dtype=torch.long, device=self.device)
        return new


def check_tasks(task_manager, tasks):
    known = set(task_manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        hints = []
        for t in unknown:
            close = difflib.get_close_matches(t, known, n=1, cutoff=0.6)
            hints.append(f"{t!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"lm_eval: unknown task {', '.join(hints)}; `lm_eval ls tasks` lists the harness's tasks, "
                         f"and --lm_eval_include_path=<folder> adds your own task YAMLs")


def run_lm_eval(model, enc, tasks, batch_size, device, ctx, limit=None, num_fewshot=None, include_path=None,
                max_gen_toks=256, seed=1234, log_samples=False, task_manager=None):
    """lm_eval.simple_evaluate on NanoGPTLM -> (the harness's Markdown table, its result dict).
    task_manager: an lm_eval TaskManager to reuse (indexing the harness's task files takes seconds)."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table
    task_manager = task_manager or TaskManager(include_path=include_path)
    check_tasks(task_manager, tasks)
    lm = NanoGPTLM(model, enc, device, ctx, batch_size=batch_size, max_gen_toks=max_gen_toks)
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=task_manager, log_samples=log_samples, random_seed=seed,
                                      numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    keep = {k: results[k] for k in ('results', 'versions', 'n-shot', 'higher_is_better', 'samples') if k in results}
    return make_table(results), keep
