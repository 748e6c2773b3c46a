"""Reference forward pass of a tiny Llama/Qwen2/Gemma3 HF folder in numpy (float64).

Usage: python3 hf_reference.py HF_DIR ID [ID ...]   → prints JSON: logits at every position.
Independent of the Rust code (reads config.json and model.safetensors itself); the test
`reference_matches_numpy` compares it with `TinyModel::reference_logits`.
"""
import json
import struct
import sys

import numpy as np


def load_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = {"F32": np.float32, "F16": np.float16}[info["dtype"]]
        out[name] = np.frombuffer(raw[base + start:base + end], dtype=dtype).reshape(info["shape"]).astype(np.float64)
    return out


def forward(folder, ids):
    cfg = json.load(open(folder + "/config.json"))
    w = load_safetensors(folder + "/model.safetensors")
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", cfg["hidden_size"] // nh)
    eps = cfg["rms_norm_eps"]
    gemma = cfg["model_type"] == "gemma3_text"
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * ((1.0 + g) if gemma else g)

    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    if gemma:
        x = x * np.sqrt(cfg["hidden_size"])

    def rope(v, theta):
        inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
        ang = np.outer(np.arange(t), inv)
        ang = np.concatenate([ang, ang], -1)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        rot = np.concatenate([-v[..., hd // 2:], v[..., :hd // 2]], -1)
        return v * cos + rot * sin

    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])

        def proj(name):
            y = h @ w[p + name + ".weight"].T
            return y + w[p + name + ".bias"] if p + name + ".bias" in w else y

        local = layer_types[layer] == "sliding_attention"
        theta = cfg["rope_local_base_freq"] if local else cfg["rope_theta"]
        q = proj("self_attn.q_proj").reshape(t, nh, hd)
        k = proj("self_attn.k_proj").reshape(t, nkv, hd)
        if gemma:
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q, theta), rope(k, theta)
        v = proj("self_attn.v_proj").reshape(t, nkv, hd)
        k = np.repeat(k, nh // nkv, axis=1)
        v = np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = s + np.triu(np.full((t, t), -np.inf), 1)[None]
        if local:
            s = s + np.tril(np.full((t, t), -np.inf), -cfg["sliding_window"])[None]
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", a, v).reshape(t, nh * hd)
        o = o @ w[p + "self_attn.o_proj.weight"].T
        if gemma:
            o = rms(o, w[p + "post_attention_layernorm.weight"])
        x = x + o
        h = rms(x, w[p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")])
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        if gemma:
            act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        else:
            act = g / (1 + np.exp(-g))
        d = (act * u) @ w[p + "mlp.down_proj.weight"].T
        if gemma:
            d = rms(d, w[p + "post_feedforward_layernorm.weight"])
        x = x + d
    h = rms(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return h @ head.T


if __name__ == "__main__":
    logits = forward(sys.argv[1], [int(i) for i in sys.argv[2:]])
    print(json.dumps(logits.tolist()))
