#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target into corpus/<target>/ (run from anywhere; the
files are committed, and a fuzzing run adds what it finds elsewhere: see scripts/fuzz)."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# grammar: the first byte picks the kind (0 Lark, 1 JSON Schema, 2 regex, 3 choices; the rest
# of the byte, divided by 4, is the offset into each mask the walk takes).
put("grammar", "lark_small", b"\x00" + b'start: "a" b\nb: "b"+ | %json {"type": "integer"}\n')
put("grammar", "lark_chain_600", b"\x00" + ("start: r0\n" + "".join(f"r{i}: r{i+1}\n" for i in range(600)) + 'r600: "x"\n').encode())
with open(os.path.join(HERE, "..", "grammar", "tests", "data", "items_bomb.lark"), "rb") as f:
    put("grammar", "items_bomb", b"\x04" + f.read())
put("grammar", "schema_object", b"\x01" + json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}}, "required": ["name"], "additionalProperties": False}).encode())
put("grammar", "schema_refs", b"\x05" + json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/a"}}]}}, "$ref": "#/$defs/a"}).encode())
put("grammar", "schema_no_instance", b"\x01" + json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}).encode())
put("grammar", "regex", b"\x02[a-z]{3,5}(-[0-9]+)?")
put("grammar", "choices", b"\x03yes\nno\nmaybe")

# openai_body: the first byte picks the route (even: completions, odd: chat).
put("openai_body", "completion", b"\x00" + json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode())
put("openai_body", "completion_ids_n", b"\x00" + json.dumps({"prompt": [[1, 2, 3], [4]], "n": 2, "logprobs": 2, "stop": ["\n"], "seed": 7}).encode())
put("openai_body", "chat", b"\x01" + json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 4}).encode())
put("openai_body", "chat_schema", b"\x01" + json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}}).encode())
put("openai_body", "not_json", b"\x00{\"prompt\": ")

# kv_wire: a frame header (magic, then fields) and a hello (magic, version, junk for the MAC).
put("kv_wire", "frame_header", struct.pack("<H", 0x4B54) + bytes(range(54)))
put("kv_wire", "hello", b"TKV1" + struct.pack("<H", 7) + bytes(64))
put("kv_wire", "empty", b"")


# gguf: version 3, one f32 tensor, a few metadata keys of several types.
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + struct.pack("<I", vtype) + payload


meta = [
    kv("general.architecture", 8, gstr("llama")),
    kv("llama.context_length", 4, struct.pack("<I", 64)),
    kv("llama.embedding_length", 4, struct.pack("<I", 8)),
    kv("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
    kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + gstr("a") + gstr("b")),
]
tensor = gstr("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 8, 2) + struct.pack("<IQ", 0, 0)
head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(meta)) + b"".join(meta) + tensor
head += bytes((-len(head)) % 32)
put("gguf", "tiny", head + struct.pack("<16f", *range(16)))
put("gguf", "magic_only", b"GGUF" + struct.pack("<I", 3))

# safetensors: an 8-byte header length, the JSON header, then the data.
def safetensors(tensors):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


put("safetensors", "small", safetensors([
    ("model.embed_tokens.weight", "F32", [4, 8], struct.pack("<32f", *range(32))),
    ("model.layers.0.input_layernorm.weight", "BF16", [8], struct.pack("<8H", *range(8))),
    ("model.norm.weight", "F16", [8], struct.pack("<8H", *range(0, 32, 4))),
]))
put("safetensors", "bad_offsets", safetensors([("model.norm.weight", "F32", [8], b"\0" * 16)]))
