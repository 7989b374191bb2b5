"""A GGUF shaped like Qwen3-30B-A3B (hidden 2048, 32 query and 4 KV heads of 128, 128 experts of
768 with 8 active, vocab 151936), with random weights and LAYERS of its 48 layers: the model of
the mixture-of-experts benchmark (scripts/bench-moe). Written as Q8_0 (random codes, scales that
keep activations near unit size), for llama-quantize to requantize to Q4_K_M with llama.cpp's own
choice of each tensor's type. Tensors are spooled to a temporary file as they are made, so memory
stays at one tensor.

    python bench/make_moe_model.py OUT.gguf LAYERS TOKENIZER.gguf

The tokenizer (its BPE tokens and merges) comes from TOKENIZER.gguf, padded with unused tokens to
the vocabulary size.
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, ACTIVE, EXPERT_FF, VOCAB = 128, 8, 768, 151936


def q8_0(rng, shape):
    """Random Q8_0 blocks for a tensor of `shape` (numpy order, last dimension the row): codes
    uniform in [-127, 127], each block's scale 1 / (73 · √cols), so a row's dot with unit-size
    activations stays near unit size."""
    *outer, cols = shape
    blocks = int(np.prod(outer)) * (cols // 32)
    raw = np.empty((blocks, 34), dtype=np.uint8)
    raw[:, 2:] = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    d = np.float16(1.0 / (73.0 * np.sqrt(cols)))
    raw[:, :2] = np.frombuffer(np.array([d], dtype=np.float16).tobytes(), dtype=np.uint8)
    return raw.reshape(*outer, cols // 32 * 34)


def main(out, layers, tok_path):
    rng = np.random.default_rng(45)
    tok = GGUFReader(tok_path)
    w = GGUFWriter(out, "qwen3moe", use_temp_file=True)
    w.add_name(f"qwen3-30b-a3b-shaped-{layers}-layers")
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(6144)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(ACTIVE)
    w.add_expert_feed_forward_length(EXPERT_FF)
    w.add_vocab_size(VOCAB)
    tokens = list(tok.fields["tokenizer.ggml.tokens"].contents())
    types = list(tok.fields["tokenizer.ggml.token_type"].contents())
    pad = VOCAB - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [TokenType.UNUSED] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(tok.fields["tokenizer.ggml.merges"].contents()))
    w.add_eos_token_id(int(tok.fields["tokenizer.ggml.eos_token_id"].contents()))
    q8 = GGMLQuantizationType.Q8_0
    ones = lambda n: np.ones(n, dtype=np.float32)
    w.add_tensor("token_embd.weight", q8_0(rng, (VOCAB, HIDDEN)), raw_dtype=q8)
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(HIDDEN))
        w.add_tensor(b + "attn_q.weight", q8_0(rng, (HEADS * HEAD_DIM, HIDDEN)), raw_dtype=q8)
        w.add_tensor(b + "attn_k.weight", q8_0(rng, (KV_HEADS * HEAD_DIM, HIDDEN)), raw_dtype=q8)
        w.add_tensor(b + "attn_v.weight", q8_0(rng, (KV_HEADS * HEAD_DIM, HIDDEN)), raw_dtype=q8)
        w.add_tensor(b + "attn_output.weight", q8_0(rng, (HIDDEN, HEADS * HEAD_DIM)),
                     raw_dtype=q8)
        w.add_tensor(b + "attn_q_norm.weight", ones(HEAD_DIM))
        w.add_tensor(b + "attn_k_norm.weight", ones(HEAD_DIM))
        w.add_tensor(b + "ffn_norm.weight", ones(HIDDEN))
        router = (rng.standard_normal((EXPERTS, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
        w.add_tensor(b + "ffn_gate_inp.weight", router)
        for t, shape in [("gate", (EXPERTS, EXPERT_FF, HIDDEN)), ("up", (EXPERTS, EXPERT_FF, HIDDEN)),
                         ("down", (EXPERTS, HIDDEN, EXPERT_FF))]:
            w.add_tensor(b + f"ffn_{t}_exps.weight", q8_0(rng, shape), raw_dtype=q8)
        print(f"layer {i + 1} of {layers}", file=sys.stderr)
    w.add_tensor("output_norm.weight", ones(HIDDEN))
    w.add_tensor("output.weight", q8_0(rng, (VOCAB, HIDDEN)), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
