"""Joint training with LoRA adapters (backbone.lora): what trains, what is saved, exact resume, the
distillation term, and decoding against the adapted backbone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtp_train.adapters import adapters_disabled, lora_layers
from mtp_train.config import BackboneConfig, LoraConfig
from mtp_train.errors import MtpError
from mtp_train.evaluation.decode import decode
from tests.helpers import run_train, train_killed_at
from tests.test_train import FAST

LORA = ["backbone.lora.enabled=true", "backbone.lora.r=4", "backbone.lora.alpha=8",
        "backbone.lora.target_modules=[q_proj,v_proj,o_proj]"]


def lora_backbone(seed: int = 0, scale: float = 0.0, **lora):
    """The tiny backbone with LoRA adapters; `scale` > 0 gives every B matrix random values (the
    adapters then change the model), 0 keeps peft's zero init."""
    from mtp_train.backbone import load_backbone

    bb = load_backbone(BackboneConfig(name="tiny-llama", source="tiny",
                                      lora=LoraConfig(enabled=True, r=4, alpha=8, **lora)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(bb.model):
            b = layer.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=g) * scale)
    return bb


def slow_kl(logits, reference, mask):
    """KL(softmax(reference) || softmax(logits)) per masked position, one position at a time."""
    vals = []
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if mask[b, t]:
                p = torch.softmax(reference[b, t].double(), -1)
                q = torch.softmax(logits[b, t].double(), -1)
                vals.append(sum(float(p[v] * (torch.log(p[v]) - torch.log(q[v]))) for v in range(p.numel())))
    return sum(vals) / len(vals)


def test_the_distillation_term_against_a_slow_reference():
    from mtp_train.losses import backbone_distill_loss

    g = torch.Generator().manual_seed(1)
    logits, reference = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    got = backbone_distill_loss(logits, reference, mask)
    assert float(got) == pytest.approx(slow_kl(logits, reference, mask), rel=1e-5)
    logits.requires_grad_(True)
    backbone_distill_loss(logits, reference, mask).backward()
    assert logits.grad[0, 2].abs().sum() == 0 and logits.grad[0, 0].abs().sum() > 0  # masked out: no gradient
    assert float(backbone_distill_loss(reference, reference, mask)) == pytest.approx(0.0, abs=1e-7)


def test_the_distillation_term_is_zero_with_zero_adapters_and_not_otherwise():
    from mtp_train.config import LossConfig, TrainConfig
    from mtp_train.heads.medusa import MedusaHeads
    from mtp_train.lit.module import MTPHeadsModule

    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    for scale, zero in ((0.0, True), (0.5, False)):
        bb = lora_backbone(scale=scale)
        heads = MedusaHeads(bb.hidden_size, bb.vocab_size, 2, 1)
        module = MTPHeadsModule(bb, heads, LossConfig(), TrainConfig(), LoraConfig(enabled=True, r=4, alpha=8))
        logits = bb.logits(bb.hidden_states(ids, attn))
        term = float(module._distill_term(ids, attn, logits).detach())
        assert (term == 0.0) if zero else (term > 1e-4), (scale, term)
        if not zero:  # it is the KL to the same weights with the adapters bypassed
            with torch.no_grad(), adapters_disabled(bb.model):
                original = bb.logits(bb.hidden_states(ids, attn))
            assert term == pytest.approx(slow_kl(logits.detach(), original, attn), rel=1e-4)
        # the adapters are back on, and still trainable, after the bypass
        assert all(p.requires_grad for n, p in bb.model.named_parameters() if "lora_" in n)
        assert torch.equal(bb.logits(bb.hidden_states(ids, attn)), logits)


@pytest.mark.integration
def test_lora_training_moves_the_adapters_not_the_base_weights_and_saves_heads_and_adapters(
        typed_cfg, tmp_path, monkeypatch):
    import mtp_train.backbone as backbone_mod

    used = []
    real_load = backbone_mod.load_backbone

    def spying_load(bcfg):
        bb = real_load(bcfg)
        used.append((bb, {n: p.detach().clone() for n, p in bb.model.named_parameters()}))
        return bb

    monkeypatch.setattr(backbone_mod, "load_backbone", spying_load)
    metrics = run_train(typed_cfg(*FAST, *LORA, "heads=chained", "heads.k=2", "loss=kl", "train.lr=1e-2"))
    assert metrics["val/loss_distill"] > 0  # the adapters moved the backbone, and the term says how far
    run = tmp_path / "out"
    bb, before = used[-1]  # the one training used
    after = dict(bb.model.named_parameters())
    base = [n for n in after if "lora_" not in n]
    lora_b = [n for n in after if "lora_B" in n]
    assert len(lora_b) == 2 * 3  # 2 layers x q, v, o
    assert all(torch.equal(after[n], before[n]) for n in base)  # the base weights are bit-identical
    assert all(not torch.equal(after[n], before[n]) for n in lora_b)  # every adapter trained
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    heads = load_file(str(run / "heads.safetensors"))
    saved = set(ckpt["state_dict"])
    assert {f"heads.{k}" for k in heads} <= saved
    rest = saved - {f"heads.{k}" for k in heads}
    assert rest and all(k.startswith("adapters.") and ".lora_" in k for k in rest)  # no base weight
    assert len(rest) == 4 * 3
    meta = json.loads((run / "heads.json").read_text())
    assert meta["adapter"]["dir"] == "adapter" and meta["adapter"]["lora"]["r"] == 4
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 12 and all(k.startswith("base_model.model.model.layers.") for k in adapter)
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and sorted(cfg["target_modules"]) == [
        "o_proj", "q_proj", "v_proj"]
    name = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"
    assert torch.equal(adapter[name], after["model.layers.1.self_attn.o_proj.lora_B.default.weight"])


@pytest.mark.integration
def test_peft_loads_the_saved_adapter_as_the_trained_backbone(typed_cfg, tmp_path):
    """The adapter directory is PEFT's own format: PeftModel.from_pretrained on the original backbone
    computes what the adapted backbone computes."""
    from peft import PeftModel

    from mtp_train.backbone import build_tiny, load_backbone
    from mtp_train.heads.persist import load_heads

    cfg = typed_cfg(*FAST, *LORA, "heads=medusa", "heads.k=2", "train.lr=1e-2")
    run_train(cfg)
    bb = load_backbone(BackboneConfig(name="tiny-llama", source="tiny"))
    load_heads(tmp_path / "out", bb)  # brings the adapters
    assert bb.adapter and lora_layers(bb.model)
    plain, _ = build_tiny(cfg.backbone.tiny)
    peft_model = PeftModel.from_pretrained(plain, str(tmp_path / "out" / "adapter")).eval()
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = bb.model(ids).logits, peft_model(ids).logits
        with adapters_disabled(bb.model):
            original = bb.model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - original).abs().max() > 1e-4  # the adapters trained away from zero


@pytest.mark.integration
def test_resume_with_lora_is_exact(typed_cfg, tmp_path, monkeypatch):

    common = [*FAST, *LORA, "heads=chained", "heads.k=2", "loss=kl", "trainer.max_steps=6",
              "train.batch_size=8", "train.warmup_steps=2", "data.distill.max_train_prompts=40",
              "trainer.val_check_interval=3", "train.lr=1e-2"]
    run_train(typed_cfg(*common, f"paths.output_dir={tmp_path}/straight"))

    # dies at step 4, after the step-3 checkpoint
    train_killed_at(typed_cfg(*common, f"paths.output_dir={tmp_path}/resumed"), 4, monkeypatch)
    run_train(typed_cfg(*common, f"paths.output_dir={tmp_path}/resumed"))
    for name in ("heads.safetensors", "adapter/adapter_model.safetensors"):
        straight, resumed = (load_file(str(tmp_path / d / name)) for d in ("straight", "resumed"))
        assert straight.keys() == resumed.keys()
        for k in straight:
            torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=1e-6, msg=f"{name}: {k}")


@pytest.mark.parametrize("heads_type", ["medusa", "chained", "eagle3"])
def test_decoding_with_adapters_equals_a_greedy_loop_of_the_adapted_model(heads_type):
    from mtp_train.config import HeadsConfig
    from mtp_train.decoding import Decoder
    from mtp_train.heads.persist import build_heads

    bb = lora_backbone(seed=2, scale=0.3)
    torch.manual_seed(0)
    cfg = HeadsConfig(type=heads_type, k=3, aux_layers=[0, 1] if heads_type == "eagle3" else None)
    heads = build_heads(cfg, bb).eval()
    prompt = torch.randint(0, 200, (9,), generator=torch.Generator().manual_seed(5)).tolist()

    def greedy_loop(n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(bb.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    want = greedy_loop(24)
    dec = Decoder(bb, heads, eos_ids=[-1])
    for mode in ("greedy", "verify"):
        assert decode(dec, prompt, 24, mode).tokens == want, mode
    with adapters_disabled(bb.model):
        original = greedy_loop(24)
    assert original != want  # the adapters change what the backbone says: the check has teeth


@pytest.mark.bad_input
@pytest.mark.integration
def test_heads_whose_adapters_are_missing_or_changed_are_refused(typed_cfg, tmp_path):
    from mtp_train.backbone import load_backbone
    from mtp_train.heads.persist import load_heads

    run_train(typed_cfg(*FAST, *LORA, "heads=medusa", "heads.k=2", "train.lr=1e-2"))
    run = tmp_path / "out"
    weights = run / "adapter" / "adapter_model.safetensors"
    fresh = lambda: load_backbone(BackboneConfig(name="tiny-llama", source="tiny"))  # noqa: E731
    data = weights.read_bytes()
    weights.write_bytes(data[:-8] + bytes(8))
    with pytest.raises(MtpError, match="not the adapters these heads were trained with"):
        load_heads(run, fresh())
    weights.unlink()
    with pytest.raises(MtpError, match="trained with LoRA adapters, but .*adapter_model.safetensors is missing"):
        load_heads(run, fresh())


@pytest.mark.integration
def test_with_lora_the_backbone_runs_live_and_says_so_when_the_cache_was_asked(typed_cfg, caplog, monkeypatch):
    import logging

    import mtp_train.pipeline.training as training

    opened = []
    monkeypatch.setattr(training, "open_cache", lambda *a, **k: opened.append(1))
    with caplog.at_level(logging.INFO):
        run_train(typed_cfg(*FAST, *LORA, "heads=medusa", "heads.k=2", "train.use_cache=true"))
    assert not opened
    assert "the hidden-state cache is not used" in caplog.text


def test_backbone_drift_against_greedy_loops_of_the_adapted_and_the_original_model():
    from mtp_train.backbone import build_tiny
    from mtp_train.config import TinyBackboneConfig
    from mtp_train.evaluation.metrics import backbone_nll
    from mtp_train.evaluation.runner import backbone_drift

    bb = lora_backbone(seed=4, scale=0.3)
    plain, _ = build_tiny(TinyBackboneConfig())  # the original weights, built anew: no adapter anywhere
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 8, 11)]

    def loop(model, prompt, n=10):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    drift = backbone_drift(bb, prompts, eos=[-1], max_new_tokens=10)
    adapted = [loop(bb.model, p) for p in prompts]
    original = [loop(plain, p) for p in prompts]
    same = [a == o for a, o in zip(adapted, original, strict=True)]
    assert drift["greedy_match_rate"] == pytest.approx(sum(same) / 3) and not all(same)
    prefix = []
    for a, o in zip(adapted, original, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, o, strict=True)) if x != y), len(o))
        prefix.append(k / len(o))
    assert drift["prefix_match"] == pytest.approx(sum(prefix) / 3)
    from mtp_train.backbone import Backbone

    ref = Backbone(model=plain, tokenizer=bb.tokenizer, name="plain")
    nll_a = sum(backbone_nll(ref, p, a) for p, a in zip(prompts, adapted, strict=True)) / 3
    nll_o = sum(backbone_nll(ref, p, o) for p, o in zip(prompts, original, strict=True)) / 3
    assert drift["original_nll_on_adapted"] == pytest.approx(nll_a, rel=1e-4)
    assert drift["original_nll_on_original"] == pytest.approx(nll_o, rel=1e-4)
    assert drift["nll_increase"] == pytest.approx(nll_a - nll_o, abs=1e-4) and nll_a > nll_o


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config_rules import validate

    root = tmp_path_factory.mktemp("lora")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(compose("config", overrides=[f"paths.root_dir={root}", f"paths.output_dir={root}/train",
                                                    *FAST, *LORA, "heads=medusa", "heads.k=2", "train.lr=2e-2",
                                                    "trainer.max_steps=8"]))
    run_train(cfg)
    return root


@pytest.mark.integration
def test_eval_of_lora_heads_verifies_against_the_adapted_backbone_and_reports_its_drift(lora_run):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config_rules import validate
    from tests.helpers import run_eval

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(compose("config", overrides=[
            f"paths.root_dir={lora_run}", f"paths.output_dir={lora_run}/eval", *FAST, "heads=medusa",
            "eval.n_prompts=3", "eval.max_new_tokens=12", "eval.rounds=1", f"eval.train_run={lora_run}/train",
            "eval.modes=[greedy,verify]"]))
    report = run_eval(cfg)
    adapted = report["backbone_adapted"]
    assert adapted["adapter"].endswith("adapter") and adapted["merged_layers"] == 6
    d = adapted["drift"]
    assert d["n_prompts"] == 3 and 0 <= d["greedy_match_rate"] <= d["prefix_match"] + 1e-9 <= 1 + 1e-9
    assert report["modes"]["verify"]["identical_to_greedy"] is True
    saved = json.loads((lora_run / "eval" / "eval_report.json").read_text())
    assert saved["backbone_adapted"]["drift"] == d


@pytest.mark.integration
def test_exports_carry_the_adapters(lora_run, tmp_path):
    """native from the checkpoint: the same PEFT adapter; medusa for vLLM: the adapted backbone,
    merged, named as the one to serve with, computing what the adapted backbone computes."""
    import shutil

    from transformers import AutoModelForCausalLM

    from mtp_train.backbone import load_backbone
    from mtp_train.heads.persist import load_heads
    from mtp_train.pipeline.export import export_heads
    from mtp_train.pipeline.serving import export_for_engine

    run = tmp_path / "run"
    shutil.copytree(lora_run / "train", run)
    trained = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    shutil.rmtree(run / "adapter")
    export_heads(run)  # from checkpoints/last.ckpt
    again = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert again.keys() == trained.keys() and all(torch.equal(again[k], trained[k]) for k in trained)

    out = export_for_engine(run, "medusa", tmp_path / "served")
    serving = json.loads((out / "mtp_serving.json").read_text())
    assert serving["backbone"] == str((out / "merged_backbone").resolve()) and serving["lora_adapter"]
    target = AutoModelForCausalLM.from_pretrained(out / "merged_backbone").eval()
    assert not any("lora" in n for n in target.state_dict())
    bb = load_backbone(BackboneConfig(name="tiny-llama", source="tiny"))
    load_heads(run, bb)
    ids = torch.randint(0, 200, (1, 14), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, bb.model(ids).logits, rtol=1e-4, atol=1e-4)
        with adapters_disabled(bb.model):
            assert (target(ids).logits - bb.model(ids).logits).abs().max() > 1e-4


@pytest.mark.bad_input
@pytest.mark.integration
def test_clp_labels_from_the_original_backbones_cache_are_refused_for_lora_heads(lora_run):
    from hydra import compose, initialize_config_dir

    from mtp_train.cli.common import CONF_DIR
    from mtp_train.config_rules import validate
    from mtp_train.errors import ConfigError
    from mtp_train.pipeline.clp_run import run_clp

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = validate(compose("config", overrides=[
            f"paths.root_dir={lora_run}", f"paths.output_dir={lora_run}/clp", *FAST, "heads=medusa",
            f"clp.train_run={lora_run}/train", "clp.label_source=cache"]))
    with pytest.raises(ConfigError, match="trained with LoRA adapters and draft for the adapted one"):
        run_clp(cfg)


def test_every_adapter_gets_a_gradient_and_its_own_learning_rate_even_without_the_distillation_term():
    """EAGLE-3 heads read layers' inputs only, so the adapters of the last layer get gradient from the
    distillation term alone; with distill_weight=0 they must still be in the graph (DDP with
    find_unused_parameters=false stops otherwise), with a zero gradient."""
    from mtp_train.config import HeadsConfig, LossConfig, TrainConfig
    from mtp_train.heads.persist import build_heads
    from mtp_train.lit.module import MTPHeadsModule

    bb = lora_backbone(scale=0.1)
    heads = build_heads(HeadsConfig(type="eagle3", k=2, aux_layers=[0, 1]), bb)
    lora = LoraConfig(enabled=True, r=4, alpha=8, distill_weight=0.0, lr=5e-4)
    module = MTPHeadsModule(bb, heads, LossConfig(name="kl"), TrainConfig(lr=1e-3), lora)
    module.log = lambda *a, **k: None  # no Trainer here
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    module.model_step(batch, "train").backward()
    grads = {n: p.grad for n, p in module.adapters.named_parameters()}
    assert grads and all(g is not None for g in grads.values())
    last = [n for n in grads if n.startswith("model__layers__1__") and "lora_A" in n]
    assert last and all(grads[n].abs().sum() == 0 for n in last)  # layer 1's output is read by nobody
    assert any(grads[n].abs().sum() > 0 for n in grads if n.startswith("model__layers__0__"))
    groups = module.param_groups()
    assert groups[-1]["lr"] == 5e-4 and {id(p) for p in groups[-1]["params"]} == {
        id(p) for p in module.adapters.parameters()}


def test_lora_dropout_follows_train_and_eval_and_adapters_stay_off_embeddings():
    bb = lora_backbone(dropout=0.5)
    drops = [m.lora_dropout["default"] for _, m in lora_layers(bb.model)]
    assert drops and not any(d.training for d in drops)  # a frozen backbone evaluates: no dropout
    from mtp_train.adapters import adapter_modules

    container = adapter_modules(bb.model)
    container.train()
    assert all(d.training for d in drops)
    container.eval()
    assert not any(d.training for d in drops)
    with pytest.raises(MtpError, match="backbone.lora.target_modules: lm_head is the LM head"):
        lora_backbone(target_modules=["lm_head"])


def test_chained_heads_copy_the_original_last_layer_of_a_lora_backbone():
    from mtp_train.config import HeadsConfig
    from mtp_train.heads.persist import build_heads

    bb = lora_backbone()
    heads = build_heads(HeadsConfig(type="chained", k=2, init="copy_last"), bb)
    q = bb.model.model.layers[-1].self_attn.q_proj.get_base_layer().weight
    copied = [t for n, t in heads.state_dict().items() if n.endswith("self_attn.q_proj.weight")]
    assert len(copied) == 2 and all(torch.equal(t, q) for t in copied)


@pytest.mark.bad_input
@pytest.mark.parametrize("where", ["../elsewhere", "/tmp", "adapter/../../x", 7])
def test_an_adapter_dir_outside_the_run_is_refused(tmp_path, where):
    """heads.json names the run's own adapter directory; one pointing elsewhere is never loaded."""
    from mtp_train.adapters import attach_run_adapter
    from mtp_train.errors import MtpError

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(MtpError, match=r"adapter\.dir .* is not a directory inside the run"):
        attach_run_adapter(run, {"dir": where, "sha256": None}, backbone=None)
