"""model.py's GPT as a transformers causal LM, for
AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True): the same forward pass (model.py is
the copy beside this file) and generate() with model.py's own decoding cache."""
import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_denoised_gpt import DenoisedGPTConfig
from .model import GPT, KVCache

# transformers 5 renamed the decoding state `past_key_values` to `cache` (in generate's calls to forward and in
# the output classes); 4.x knows only the old name. forward takes both and answers under the installed one.
CACHE_FIELD = 'cache' if 'cache' in CausalLMOutputWithPast.__dataclass_fields__ else 'past_key_values'


class DenoisedGPTCache(KVCache):
    """model.py's decoding state, carried by generate() from step to step: per layer the keys and values,
    linear attention's (S, z) or DINT's running sum. Not a transformers Cache, whose layers hold keys and
    values only; generate() needs no more of it than these few members."""
    is_compileable = False
    is_croppable = False

    def get_seq_length(self, layer_idx=0):
        return self.length

    def reorder_cache(self, beam_idx):  # beam search keeps some sequences and repeats others
        for layer in self.layers:
            for name, value in layer.items():
                if torch.is_tensor(value):
                    layer[name] = value.index_select(0, beam_idx.to(value.device))


class DenoisedGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DenoisedGPTConfig
    base_model_prefix = 'gpt'  # model.safetensors holds GPT's own state_dict: its names without 'gpt.'
    _tied_weights_keys = {'gpt.lm_head.weight': 'gpt.transformer.wte.weight'}

    def __init__(self, config):
        super().__init__(config)
        self.gpt = GPT(config.gpt_config())
        self.post_init()

    def _init_weights(self, module):
        pass  # GPT initialises its own parameters (from_pretrained then replaces them all)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # generate() takes the cache the first forward returns (DenoisedGPTCache)

    def get_input_embeddings(self):
        return self.gpt.transformer.wte

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def forward(self, input_ids, attention_mask=None, cache=None, past_key_values=None, use_cache=False, labels=None,
                logits_to_keep=0, **kwargs):
        """Logits of every position (or the last logits_to_keep); cache (past_key_values before transformers 5):
        the state of the tokens before input_ids; labels: the input ids, shifted here (the loss is the mean
        cross-entropy). Other keyword arguments generate() and pipelines pass (return_dict, ...) change nothing."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported (attention_mask has zeros): the model attends to "
                             "every token before the current one; run sequences of different lengths separately")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DenoisedGPTCache(self.config.n_layer)
        # GPT.forward computes lm_head at the last position only; its final hidden states give all of them
        hidden = []
        hook = self.gpt.transformer.ln_f.register_forward_hook(lambda module, args, out: hidden.append(out))
        try:
            self.gpt(input_ids, kv_cache=cache)
        finally:
            hook.remove()
        logits = self.gpt.lm_head(hidden[0][:, -logits_to_keep:])  # -0: every position
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
