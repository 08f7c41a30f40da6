"""The tiny-model kit: a real HF folder that MLX and transformers both load, with matching logits."""

import hashlib
import json

import numpy as np
import pytest

from stoa.models.tiny import SPECIAL_TOKENS, TAG_TOKENS, TinyConfig, build_tiny

WORDS = ("Kavorin inhibits the kinase Mertil in hepatocytes . Which receptor does Dolvex activate ? "
         "Protein Samirel binds Tenvora in neurons and regulates expression of Orbrin").split()


def texts(n=1500, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=10)) for _ in range(n)]


CFG = TinyConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), texts(), CFG)


def test_files_and_determinism(tiny, tmp_path):
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "generation_config.json"}
    assert names <= {p.name for p in tiny.iterdir()}
    again = build_tiny(tmp_path / "again", texts(), CFG)
    for name in names:
        assert hashlib.sha256((tiny / name).read_bytes()).digest() == hashlib.sha256((again / name).read_bytes()).digest(), name
    other = build_tiny(tmp_path / "other", texts(), TinyConfig(**{**CFG.__dict__, "seed": 1}))
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_tokenizer_ids_fit_the_embedding(tiny):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    cfg = json.loads((tiny / "config.json").read_text())
    vocab = tok.get_vocab(with_added_tokens=True)
    assert max(vocab.values()) < cfg["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        assert t in vocab
    # Tags are whole tokens and decode back to themselves.
    ids = tok.encode("<search> Kavorin </search>").ids
    assert ids[0] == vocab["<search>"] and ids[-1] == vocab["</search>"]
    assert tok.decode(ids, skip_special_tokens=False) == "<search> Kavorin </search>"


@pytest.mark.parametrize("bad", [dict(hidden_size=100), dict(intermediate_size=96), dict(num_heads=3),
                                 dict(num_kv_heads=3), dict(vocab_size=100)])
def test_config_bounds(bad):
    with pytest.raises(ValueError):
        TinyConfig(**bad)


def test_mlx_and_torch_logits_match(tiny):
    import mlx.core as mx
    import mlx_lm
    import torch
    import transformers

    mlx_model, mlx_tok = mlx_lm.load(str(tiny))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    vocab = hf_model.config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, size=(3, 48))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    got = np.array(mlx_model(mx.array(ids)).astype(mx.float32))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel

    # The chat template is ChatML and ends with the assistant header.
    prompt = mlx_tok.apply_chat_template([{"role": "user", "content": "Which kinase?"}], add_generation_prompt=True)
    assert mlx_tok.decode(prompt) == "<|im_start|>user\nWhich kinase?<|im_end|>\n<|im_start|>assistant\n"
    assert mlx_tok.eos_token_id == mlx_tok.convert_tokens_to_ids("<|im_end|>")
