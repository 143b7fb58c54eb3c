"""The configuration of a model exported by export_hf.py: every field of model.py's GPTConfig (attn_type
and the variant's settings included), under its own name, plus what transformers keeps beside them."""
from dataclasses import fields

from transformers import PretrainedConfig

from .model import GPTConfig


class DenoisedGPTConfig(PretrainedConfig):
    model_type = 'denoised_gpt'
    # the names other tools (lm-eval, pipelines) look up for the context length and the model's size
    attribute_map = {'max_position_embeddings': 'block_size', 'hidden_size': 'n_embd',
                     'num_hidden_layers': 'n_layer', 'num_attention_heads': 'n_head'}

    def __init__(self, **kwargs):
        defaults = {f.name: f.default for f in fields(GPTConfig)}
        # GPT ties lm_head to the token embedding: transformers stores the tensor once and ties it again
        super().__init__(**{**defaults, 'tie_word_embeddings': True, **kwargs})

    def gpt_config(self):
        """model.py's GPTConfig of these settings (it checks them)."""
        return GPTConfig(**{f.name: getattr(self, f.name) for f in fields(GPTConfig)})
