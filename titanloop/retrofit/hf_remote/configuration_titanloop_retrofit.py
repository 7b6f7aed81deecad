"""Hugging Face config of a titanloop Ouroboros-retrofit model (model_type "titanloop_retrofit").

Written by titanloop (titanloop/retrofit/hf_remote) and copied next to the weights on export; load with
AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True). Not an Ouro model.
"""

from transformers import PretrainedConfig


class TitanloopRetrofitConfig(PretrainedConfig):
    model_type = "titanloop_retrofit"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        n_prelude=1,
        n_coda=1,
        n_loops=1,
        max_loops=16,
        modulation="controller",
        lora_rank=32,
        lora_alpha=16.0,
        style_dim=128,
        pooling="causal",
        gated_recurrence=True,
        step_norm=True,
        source_model_type=None,
        source_layers=None,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = (
            num_attention_heads,
            num_key_value_heads,
            head_dim,
        )
        self.intermediate_size, self.rms_norm_eps, self.rope_theta = intermediate_size, rms_norm_eps, rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.qkv_bias, self.o_bias, self.mlp_bias = qkv_bias, o_bias, mlp_bias
        self.n_prelude, self.n_coda, self.n_loops, self.max_loops = n_prelude, n_coda, n_loops, max_loops
        self.modulation, self.lora_rank, self.lora_alpha = modulation, lora_rank, lora_alpha
        self.style_dim, self.pooling = style_dim, pooling
        self.gated_recurrence, self.step_norm = gated_recurrence, step_norm
        self.source_model_type, self.source_layers = source_model_type, source_layers  # provenance only
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
