#!/usr/bin/env python3
"""Makes the tiny random-weight models of each supported family and their HF references.

Run once (it needs torch, transformers, tokenizers, safetensors and gguf) and commit what it
writes; the tests read the committed files and need none of these. For each family it writes
into `model/tests/families/<family>/`:

- an HF directory: config.json, model.safetensors (float32), tokenizer.json,
  tokenizer_config.json (with the family's chat template), generation_config.json;
- model.gguf: the same weights converted to GGUF (float32) the way llama.cpp's converter lays
  them out for that architecture (Llama's q/k rows permuted for its rotary layout, Llama 3's
  rope scaling as a rope_freqs tensor, Qwen's left as they are);
- reference.json: token ids of a prompt, HF transformers' float32 logits at every position of
  it, and the greedy continuation HF generates.

The weights are random but fixed (seeded), the vocabulary is a 384-token byte-level BPE trained
here on a few sentences, with each family's special tokens.

Usage: python3 make_tiny_models.py OUT_DIR [FAMILY...]   (every family when none is named)
"""

import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tandem serves language models: prefill on one worker, decode on another.",
    "A small robot learned to sing songs about the sea, the sky and the river.",
    "Once upon a time there was a village in the mountains where it snowed all year.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and then 11, 12, 13.",
    "def add(a, b):\n    return a + b\n",
    "{\"name\": \"tandem\", \"layers\": 2, \"ok\": true}",
]

PROMPT = "Once upon a time, a small robot learned to sing about the river and the sea."

# Qwen2 and Qwen3 write turns the same way (ChatML).
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2, Qwen3 and Qwen3-MoE: the same special tokens and chat format.
QWEN_TOKENS = {
    "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "bos": None,
    "eos": "<|im_end|>",
    "add_bos": False,
    "template": QWEN_TEMPLATE,
}

# Mistral and Mixtral write turns the same way, with the same special tokens.
MISTRAL_TOKENS = {
    "special": ["<s>", "</s>", "[INST]", "[/INST]"],
    "bos": "<s>",
    "eos": "</s>",
    "add_bos": True,
    "template": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
        "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}

FAMILIES = {
    "llama3": {
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "add_bos": True,
        "template": (
            "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}"
        ),
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            "tie_word_embeddings": True,
        },
    },
    "mistral": {
        **MISTRAL_TOKENS,
        "config": {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "rope_theta": 10000.0,
            # Shorter than the prompt, so the window changes the answer.
            "sliding_window": 8,
            "tie_word_embeddings": False,
        },
    },
    "qwen2": {
        **QWEN_TOKENS,
        "config": {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        },
    },
    "qwen3": {
        **QWEN_TOKENS,
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "rope_theta": 1000000.0,
            "head_dim": 24,
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
    },
    "qwen3_moe": {
        **QWEN_TOKENS,
        "config": {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "rope_theta": 1000000.0,
            "head_dim": 24,
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    },
    "mixtral": {
        **MISTRAL_TOKENS,
        "config": {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    },
}

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "torch_dtype": "float32",
}


def tokenizer_for(fam):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=fam["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    if fam["add_bos"]:
        bos = fam["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def gguf_permute(w, n_head):
    # llama.cpp's converter: HF's rotate-half rows into interleaved pairs, per head.
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hub_layout(state, model_type):
    """transformers keeps every expert of a layer in fused tensors (gate|up, down); checkpoints
    as published keep one tensor per expert and projection, under each family's names."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return state
    out = {}
    for key, t in state.items():
        prefix = key.rsplit(".mlp.", 1)[0]
        moe = "mlp" if model_type == "qwen3_moe" else "block_sparse_moe"
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        if model_type == "mixtral":
            names = {"gate": "w1", "up": "w3", "down": "w2"}
        if key.endswith(".mlp.experts.gate_up_proj"):
            ff = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{moe}.experts.{e}.{names['gate']}.weight"] = t[e, :ff].contiguous()
                out[f"{prefix}.{moe}.experts.{e}.{names['up']}.weight"] = t[e, ff:].contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{prefix}.{moe}.experts.{e}.{names['down']}.weight"] = t[e].contiguous()
        elif key.endswith(".mlp.gate.weight"):
            out[f"{prefix}.{moe}.gate.weight"] = t
        else:
            out[key] = t
    return out


def routing_margin(model, ids, k):
    """The smallest gap, over every layer and position, between a token's k-th and (k+1)-th
    expert probabilities: a near tie could pick different experts on another machine."""
    gaps = []

    def hook(_m, inp, _out):
        probs = torch.softmax(torch.nn.functional.linear(inp[0], _m.weight).float(), dim=-1)
        top = torch.topk(probs.reshape(-1, probs.shape[-1]), k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    hs = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hs:
        h.remove()
    return min(gaps)


def write_gguf(path, name, cfg, conf, state, tok, fam, arch):
    import gguf
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(conf["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    window = conf.get("sliding_window")
    if window:
        w.add_sliding_window(window)
    experts = conf.get("num_experts") or conf.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(conf["num_experts_per_tok"])
        if "moe_intermediate_size" in conf:
            w.add_expert_feed_forward_length(conf["moe_intermediate_size"])
    # Tokenizer, as llama.cpp stores a byte-level BPE ("gpt2").
    vocab = json.loads(tok.to_str())["model"]
    ids = sorted(vocab["vocab"].items(), key=lambda kv: kv[1])
    special = set(fam["special"])
    tokens = [t for t, _ in ids]
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]
    w.add_token_merges(merges)
    if fam["bos"]:
        w.add_bos_token_id(tok.token_to_id(fam["bos"]))
    w.add_add_bos_token(fam["add_bos"])
    w.add_eos_token_id(tok.token_to_id(fam["eos"]))
    w.add_chat_template(fam["template"])
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    permute = arch == "llama"
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    for key, t in state.items():
        a = t.detach().to(torch.float32).numpy()
        if ".mlp.experts." in key or key.endswith(".mlp.gate.weight"):
            # llama.cpp's merged tensors of every expert ([experts, rows, cols]) and its router.
            layer = key.split(".")[2]
            if key.endswith("gate_up_proj"):
                ff = a.shape[1] // 2
                w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, :ff]))
                w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(a[:, ff:]))
            elif key.endswith("down_proj"):
                w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(a))
            else:
                w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", np.ascontiguousarray(a))
            continue
        if key == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif key == "model.norm.weight":
            out = "output_norm.weight"
        elif key == "lm_head.weight":
            out = "output.weight"
        else:
            parts = key.split(".")
            layer, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            out = f"blk.{layer}.{names[rest]}.{kind}"
            if permute and rest == "self_attn.q_proj":
                a = gguf_permute(a, n_head)
            if permute and rest == "self_attn.k_proj":
                a = gguf_permute(a, n_kv)
        w.add_tensor(out, np.ascontiguousarray(a))
    scaling = conf.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "llama3":
        # llama.cpp's converter: Llama 3's scaling as per-frequency divisors.
        base, dim = conf["rope_theta"], head_dim
        freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        factors = []
        for f in freqs:
            wl = 2 * np.pi / f
            if wl < hi_wl:
                factors.append(1.0)
            elif wl > lo_wl:
                factors.append(factor)
            else:
                smooth = (old / wl - lo) / (hi - lo)
                factors.append(1.0 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(out_root, only):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    for family, fam in FAMILIES.items():
        if only and family not in only:
            continue
        out = os.path.join(out_root, family)
        os.makedirs(out, exist_ok=True)
        tok = tokenizer_for(fam)
        tok.save(os.path.join(out, "tokenizer.json"))
        conf = dict(SHAPE, **fam["config"])
        conf["vocab_size"] = tok.get_vocab_size()
        eos = tok.token_to_id(fam["eos"])
        conf["eos_token_id"] = eos
        if fam["bos"]:
            conf["bos_token_id"] = tok.token_to_id(fam["bos"])
        cfg = AutoConfig.for_model(**conf)
        torch.manual_seed(sum(map(ord, family)))
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            # Random, and larger than the default init, so that every part of the forward
            # (biases, norms, the window) moves the logits.
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.5 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5))
        model.eval()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(hub_layout(state, conf["model_type"]), os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})
        cfg.save_pretrained(out)
        tcfg = {"chat_template": fam["template"], "eos_token": fam["eos"],
                "add_bos_token": fam["add_bos"],
                "model_max_length": SHAPE["max_position_embeddings"]}
        if fam["bos"]:
            tcfg["bos_token"] = fam["bos"]
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump(tcfg, f, indent=1)
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": eos}, f, indent=1)
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen3_moe": "qwen3moe", "mixtral": "llama"}[conf["model_type"]]
        write_gguf(os.path.join(out, "model.gguf"), family, cfg, conf, model.state_dict(), tok,
                   fam, arch)
        ids = tok.encode(PROMPT).ids
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0].to(torch.float32).numpy()
            # Greedy as the argmax of a whole forward over everything so far, each step: the
            # definition, with no cache in between (transformers' generate() with its cache
            # parted from it on the Llama 3 model, at a step where the top two are 0.25 apart).
            gen, seq = [], list(ids)
            for _ in range(16):
                nxt = int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
                gen.append(nxt)
                seq.append(nxt)
        k = conf.get("num_experts_per_tok")
        if k:
            margin = routing_margin(model, ids + gen, k)
            print(family, "smallest routing margin", margin)
            assert margin > 1e-4, "a near tie in the routing: pick another seed"
        ref = {
            "family": family,
            "prompt": PROMPT,
            "prompt_ids": ids,
            "logits": [[float(v) for v in row] for row in logits],
            "greedy": gen,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        }
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(ref, f)
        print(family, len(ids), "prompt tokens,", cfg.vocab_size, "vocab, greedy", gen)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "model/tests/families", sys.argv[2:])
