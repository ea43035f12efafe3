"""Test helper: a writer of tiny llama GGUF files laid out as llama.cpp does."""

import numpy as np

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to W_Q and W_K (written from its description)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(path, hf_model, qtype_name: str = "F32", arch: str = "llama") -> None:
    """Write an HF Llama model as a llama.cpp-style GGUF: 2-D weights in ``qtype``, norms in F32."""
    import gguf
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType[qtype_name]
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    w.add_token_merges([])
    for name, t in hf_model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            parts = name.split(".")
            rest = ".".join(parts[3:])
            gname = f"blk.{parts[2]}.{HF_TO_GGUF[rest]}"
            if rest == "self_attn.q_proj.weight":
                a = llama_cpp_permute(a, c.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                a = llama_cpp_permute(a, c.num_key_value_heads)
        if a.ndim == 2 and qtype_name != "F32":
            w.add_tensor(
                gname, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype
            )
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
