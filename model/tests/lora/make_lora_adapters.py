#!/usr/bin/env python3
"""Makes the random LoRA adapters of the default model (SmolLM2-135M-Instruct) and their
HF transformers + PEFT float32 references.

Run once (it needs torch, transformers, peft, gguf and safetensors) and commit what it writes;
the tests read the committed files and need none of these. The base is the default model's
GGUF, loaded by transformers (which dequantizes it to float32 with gguf-py), as the golden
references of ../shared/golden were made. For each adapter it writes into OUT_DIR/<name>/:

- adapter_config.json and adapter_model.safetensors, as PEFT's save_pretrained writes them
  (the weights random, seeded: PEFT's own initialization leaves B zero, a no-op);
- reference.json: for each prompt (golden prompts, by their token ids) the greedy continuation
  of N_NEW tokens (argmax over raw logits, KV-cached, EOS not a stop) and the name of the file
  with the last prompt position's logits;
- <prompt id>.logits.bin: those logits, raw little-endian float32, one vocabulary row.

Usage: python3 make_lora_adapters.py MODEL.gguf GOLDEN_DIR OUT_DIR
"""

import json
import os
import sys

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

N_NEW = 24
PROMPTS = ["dev_short_fact", "dev_chat_default_system"]

# name: (target modules, rank, alpha, rslora, seed)
ADAPTERS = {
    "alpha": (["q_proj", "v_proj"], 8, 16, False, 1),
    "beta": ("all-linear", 4, 8, True, 2),
    "gamma": (["o_proj", "down_proj"], 16, 16, False, 3),
    "delta": (["k_proj", "gate_proj", "up_proj"], 2, 4, False, 4),
}


def base_model(gguf: str):
    d, f = os.path.split(os.path.abspath(gguf))
    m = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return m.eval()


@torch.no_grad()
def greedy(model, ids, n):
    """The last prompt position's logits and `n` greedy tokens after `ids`."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    first = out.logits[0, -1].float().numpy().copy()
    past = out.past_key_values
    tok = int(np.argmax(first))
    toks = [tok]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = int(torch.argmax(out.logits[0, -1]))
        toks.append(tok)
    return first, toks


def main(gguf: str, golden: str, out_dir: str) -> None:
    torch.set_num_threads(2)
    recs = {}
    with open(os.path.join(golden, "smollm2_greedy.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            recs[r["id"]] = r
    for name, (targets, r, alpha, rslora, seed) in ADAPTERS.items():
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        cfg = LoraConfig(
            r=r,
            lora_alpha=alpha,
            target_modules=targets,
            use_rslora=rslora,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base_model(gguf), cfg)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_A" in pname:
                    fan_in = p.shape[1]
                    p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
                elif "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        model.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        model.save_pretrained(d)
        del model
        # The reference runs the adapter as PEFT reads it back from the files written.
        model = PeftModel.from_pretrained(base_model(gguf), d).eval()
        ref = {"adapter": name, "n_new": N_NEW, "prompts": []}
        for pid in PROMPTS:
            ids = recs[pid]["prompt_ids"]
            logits, toks = greedy(model, ids, N_NEW)
            logits.astype("<f4").tofile(os.path.join(d, f"{pid}.logits.bin"))
            base = recs[pid]["generated_ids"][:N_NEW]
            print(f"{name} {pid}: {toks} (base {'same' if toks == base else 'differs'})")
            ref["prompts"].append(
                {"id": pid, "prompt_ids": ids, "greedy": toks, "logits": f"{pid}.logits.bin"}
            )
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(ref, f, indent=1)
        for junk in ["README.md"]:
            p = os.path.join(d, junk)
            if os.path.exists(p):
                os.remove(p)


if __name__ == "__main__":
    main(*sys.argv[1:4])
