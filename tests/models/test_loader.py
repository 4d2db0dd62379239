"""Checkpoint loading: sharded folders, dtypes, and the errors a wrong folder must give."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.models.reference_attention import ReferenceAttention
from hybridkv.models.registry import MODELS, load_model
from tests.models.util import GEMMA4_TINY, assert_parity, hf_logits, our_logits, prompt, save_random
from tests.tiny_models import DENSE_TINY

transformers = pytest.importorskip("transformers")

LLAMA_TINY = DENSE_TINY | {"num_hidden_layers": 2}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return save_random(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_TINY)), path), path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Hidden sizes whose square roots (the embedding scales) are not exact in half precision."""
    path = tmp_path_factory.mktemp("gemma4")
    config = transformers.Gemma4TextConfig(**{**GEMMA4_TINY, "hidden_size": 48, "hidden_size_per_layer_input": 12})
    return save_random(transformers.Gemma4ForCausalLM(config), path), path


def rewrite_weights(src, dst, edit):
    """Copy a checkpoint folder, passing its tensors through `edit(dict) -> dict`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_unknown_model_type_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'") as e:
        load_model(tmp_path)
    assert all(name in str(e.value) for name in MODELS)


def test_a_missing_tensor_is_named(llama, tmp_path):
    _, path = llama
    name = "model.layers.1.mlp.up_proj.weight"
    broken = rewrite_weights(path, tmp_path / "m", lambda w: {k: v for k, v in w.items() if k != name})
    with pytest.raises(ValueError, match=r"1 missing tensors: layers\.1\.mlp\.up_proj\.weight"):
        load_model(broken)


def test_unexpected_and_misshapen_tensors_are_named(llama, tmp_path):
    _, path = llama
    extra = rewrite_weights(
        path, tmp_path / "extra", lambda w: {**w, "model.layers.9.mlp.up_proj.weight": torch.ones(3)}
    )
    with pytest.raises(ValueError, match=r"1 unexpected tensors: model\.layers\.9\.mlp\.up_proj\.weight"):
        load_model(extra)
    wrong = rewrite_weights(path, tmp_path / "wrong", lambda w: {**w, "model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight .* shape \[3\]; the model expects \[64\]"):
        load_model(wrong)


def test_a_folder_without_weights_or_with_a_bad_dtype(llama, tmp_path):
    _, path = llama
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="unsupported model dtype 'int8'"):
        load_model(path, dtype="int8")


def test_sharded_checkpoint(llama, tmp_path):
    hf, _ = llama
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = prompt(20)
    assert_parity(our_logits(load_model(tmp_path, dtype="float32"), ids), hf_logits(hf, ids))


def test_kv_weights_of_consumer_layers_are_ignored(gemma, tmp_path):
    """Some Gemma 4 checkpoints carry k/v weights for KV-sharing layers; transformers ignores them, so do we."""
    hf, path = gemma
    name = "model.layers.6.self_attn.k_proj.weight"
    extra = rewrite_weights(
        path, tmp_path / "m", lambda w: {**w, name: w["model.layers.4.self_attn.k_proj.weight"].clone()}
    )
    ids = prompt(20)
    assert_parity(our_logits(load_model(extra, dtype="float32"), ids), hf_logits(hf, ids))


class EagerPrecisionAttention(ReferenceAttention):
    """The reference attention, rounded as transformers' eager attention rounds: products in the model dtype,
    softmax in float32."""

    def __call__(self, layer, q, kv, scale):
        if kv is not None:
            k, v = kv.unbind(1)
            self.k[layer] = torch.cat([self.k[layer], k]) if layer in self.k else k
            self.v[layer] = torch.cat([self.v[layer], v]) if layer in self.v else v
        source = self.kv_sharing.get(layer, layer)
        group = q.shape[1] // self.k[source].shape[1]
        keys, values = (t[source].repeat_interleave(group, dim=1) for t in (self.k, self.v))
        n, t = q.shape[0], keys.shape[0]
        q_pos, k_pos = torch.arange(t - n, t)[:, None], torch.arange(t)[None, :]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - (self.layer_windows[layer] or t + 1))
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        scores = scores + torch.where(visible, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hqk,khd->qhd", probs, values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["llama", "gemma"])
def test_half_precision_is_bit_exact_with_transformers_eager(request, which, dtype, monkeypatch):
    """The plain-torch model (HYBRIDKV_KERNELS=torch) rounds where transformers does: the same bits. The fused
    norm and activation kernels of the native path round once instead: there the logits' distance to float32
    transformers is at most 1.5x that of half-precision transformers (its own rounding)."""
    _, path = request.getfixturevalue(which)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    ids = prompt(40)
    want = hf_logits(hf, ids)
    for mode in ("torch", "native"):
        monkeypatch.setenv("HYBRIDKV_KERNELS", mode)
        model = load_model(path, dtype=dtype)
        assert {p.dtype for p in model.parameters() if p.device.type != "meta"} == {dtype}
        with torch.no_grad():
            ours = model.compute_logits(model(ids, torch.arange(len(ids)), EagerPrecisionAttention.for_model(model)))
        if mode == "torch":
            assert torch.equal(ours, want)
        else:
            exact = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ids)

            def rms(x):
                return x.float().pow(2).mean().sqrt()

            assert rms(ours.float() - exact) <= 1.5 * rms(want.float() - exact)
