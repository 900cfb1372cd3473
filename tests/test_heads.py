"""Draft heads on the tiny backbone: starting points, causality, no shared weights, no backbone in the state."""

from __future__ import annotations

import pytest
import torch

from mtp_train.config import HeadsConfig
from mtp_train.errors import MtpError
from mtp_train.heads.persist import build_heads, count_parameters


def _ids(bb, B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, bb.vocab_size, (B, T), generator=g)


@pytest.mark.parametrize("lm_head", ["shared", "copy"])
def test_fresh_medusa_heads_start_as_the_backbones_next_token_head(tiny_backbone, lm_head):
    bb = tiny_backbone
    heads = build_heads(HeadsConfig(type="medusa", k=3, num_layers=2, lm_head=lm_head), bb)
    ids = _ids(bb)
    with torch.no_grad():
        h = bb.hidden_states(ids)
        logits = heads.project(heads(h, ids, bb.embed_tokens), bb.lm_head)  # (B, T, k, V)
    assert logits.shape == (2, 9, 3, bb.vocab_size)
    for j in range(3):
        torch.testing.assert_close(logits[:, :, j], bb.logits(h))


@pytest.mark.parametrize("cfg", [HeadsConfig(type="medusa", k=3, num_layers=2),
                                 HeadsConfig(type="medusa", k=3, lm_head="copy"),
                                 HeadsConfig(type="chained", k=3)])
def test_depths_share_no_weights(tiny_backbone, cfg):
    heads = build_heads(cfg, tiny_backbone)
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs))
    # perturbing depth 0 leaves the other depths untouched
    before = {n: p.clone() for n, p in heads.named_parameters()}
    with torch.no_grad():
        for n, p in heads.named_parameters():
            if ".0." in n:
                p.add_(1.0)
    changed = {n for n, p in heads.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".0." in n for n in changed)


@pytest.mark.parametrize("cfg", [HeadsConfig(type="medusa", k=2), HeadsConfig(type="chained", k=2)])
def test_heads_state_dict_holds_no_backbone_tensor(tiny_backbone, cfg):
    heads = build_heads(cfg, tiny_backbone)
    backbone_ptrs = {p.data_ptr() for p in tiny_backbone.model.parameters()}
    assert not any(t.data_ptr() in backbone_ptrs for t in heads.state_dict().values())
    assert not any("embed_tokens" in k or k.startswith("lm_head") for k in heads.state_dict())
    n = count_parameters(heads)
    assert n["trainable"] == n["total"] > 0


def test_chained_module_j_reads_token_t_plus_j_and_is_causal(tiny_backbone):
    bb = tiny_backbone
    heads = build_heads(HeadsConfig(type="chained", k=3), bb)
    with torch.no_grad():  # make the embedding half of every projection matter
        for p in heads.proj:
            p.weight[:, : bb.hidden_size].normal_(0, 0.1)
    ids = _ids(bb, B=1, T=10)
    p = 6
    changed_ids = ids.clone()
    changed_ids[0, p] = (ids[0, p] + 1) % bb.vocab_size
    with torch.no_grad():
        out = heads(bb.hidden_states(ids), ids, bb.embed_tokens)  # (1, T, k, d)
        # keep the backbone hidden states fixed, change only the token fed to the modules
        out2 = heads(bb.hidden_states(ids), changed_ids, bb.embed_tokens)
    for j in range(1, 4):
        diff = (out[0, :, j - 1] - out2[0, :, j - 1]).abs().amax(-1)  # (T,)
        assert torch.all(diff[: p - j] == 0), (j, diff)  # positions before t = p - j: untouched
        assert diff[p - j] > 0, j  # position p - j reads x_p at depth j


def test_shared_chained_module_is_one_module_applied_at_every_depth(tiny_backbone, typed_cfg, tmp_path):
    """heads.share: 1/k of the parameters, and the forward equals a slow loop that feeds depth j's
    output and the token j + 1 ahead to the same module."""
    from mtp_train.heads.persist import load_heads

    bb = tiny_backbone
    torch.manual_seed(0)
    shared = build_heads(HeadsConfig(type="chained", k=3, share=True), bb)
    separate = build_heads(HeadsConfig(type="chained", k=3), bb)
    assert 3 * count_parameters(shared)["trainable"] == count_parameters(separate)["trainable"]
    with torch.no_grad():
        for p in shared.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = _ids(bb, B=2, T=9)
    with torch.no_grad():
        h = bb.hidden_states(ids)
        out = shared(h, ids, bb.embed_tokens)  # (B, T, k, d)
        emb = bb.embed_tokens(ids)
        prev = h
        for j in range(1, 4):
            ahead = torch.cat([emb[:, j:], torch.zeros_like(emb[:, :j])], 1)
            x = shared.proj[0](torch.cat([shared.norm_emb[0](ahead), shared.norm_hidden[0](prev)], -1))
            prev = shared.blocks[0](inputs_embeds=x).last_hidden_state
            torch.testing.assert_close(out[:, :, j - 1], prev)
    # the setting travels with the heads: heads.json rebuilds the shared layout
    from mtp_train.pipeline.training import save_heads

    save_heads(tmp_path, shared, bb, typed_cfg("heads=chained", "heads.k=3", "heads.share=true"), metrics={})
    again, meta = load_heads(tmp_path, bb)
    assert again.share and meta["heads"]["share"] is True and len(again.blocks) == 1


def test_chained_copy_last_starts_from_the_backbones_last_layer(tiny_backbone):
    heads = build_heads(HeadsConfig(type="chained", k=2, init="copy_last"), tiny_backbone)
    last = tiny_backbone.model.base_model.layers[-1].state_dict()
    for blk in heads.blocks:
        for name, t in blk.layers[0].state_dict().items():
            assert torch.equal(t, last[name])


def test_heads_train(tiny_backbone):
    """A few steps of CE on a fixed batch lower the loss for both families (gradients flow)."""
    bb = tiny_backbone
    ids = _ids(bb, B=2, T=12)
    for cfg in (HeadsConfig(type="medusa", k=2), HeadsConfig(type="chained", k=2)):
        torch.manual_seed(0)
        heads = build_heads(cfg, bb)
        opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
        with torch.no_grad():
            h = bb.hidden_states(ids)
        losses = []
        for _ in range(30):
            logits = heads.project(heads(h, ids, bb.embed_tokens), bb.lm_head)  # (B, T, k, V)
            T = ids.shape[1]
            # depth j+1 at position t drafts token t + 2 + j
            loss = sum(torch.nn.functional.cross_entropy(
                logits[:, : T - 2 - j, j].reshape(-1, bb.vocab_size), ids[:, 2 + j:].reshape(-1))
                for j in range(2))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.8 * losses[0], (cfg.type, losses)
        assert all(p.grad is None for p in bb.model.parameters())


@pytest.mark.parametrize("cfg", [HeadsConfig(type="medusa", k=2, lm_head="copy"),
                                 HeadsConfig(type="medusa", k=2), HeadsConfig(type="chained", k=2)])
def test_a_draft_vocabulary_scores_exactly_the_full_logits_columns(tiny_backbone, cfg):
    bb = tiny_backbone
    draft = torch.tensor([3, 7, 8, 40, 100, 258])
    torch.manual_seed(0)
    full = build_heads(cfg, bb)
    torch.manual_seed(0)
    sub = build_heads(cfg, bb, draft_ids=draft)
    sub.load_state_dict({**full.state_dict(), "draft_ids": draft} if cfg.lm_head == "shared" else
                        {**{n: t[draft] if n.startswith("lm_heads") else t
                            for n, t in full.state_dict().items()}, "draft_ids": draft})
    ids = _ids(bb)
    with torch.no_grad():
        h = bb.hidden_states(ids)
        a = full.project(full(h, ids, bb.embed_tokens), bb.lm_head)  # (B, T, k, V)
        b = sub.project(sub(h, ids, bb.embed_tokens), bb.lm_head)  # (B, T, k, 6)
    torch.testing.assert_close(b, a[..., draft])
    assert torch.equal(sub.to_tokens(torch.tensor([0, 5])), torch.tensor([3, 258]))
    assert sub.to_draft(torch.tensor([3, 4, 258, 0])).tolist() == [0, -1, 5, -1]
    assert full.draft_size == bb.vocab_size and sub.draft_size == 6


def test_select_draft_vocab_keeps_the_most_frequent_and_the_special_tokens():
    import numpy as np

    from mtp_train.heads.vocab import select_draft_vocab

    counts = np.array([5, 0, 9, 9, 1, 7, 0])
    assert select_draft_vocab(counts, 3).tolist() == [2, 3, 5]  # ties broken by the lower id
    assert select_draft_vocab(counts, 3, always=(6,)).tolist() == [2, 3, 6]
    with pytest.raises(ValueError, match="sorted"):
        build_heads(HeadsConfig(type="medusa", k=1), _Fake(), draft_ids=torch.tensor([4, 2]))


class _Fake:  # the parts of a backbone MedusaHeads reads
    hidden_size, vocab_size = 4, 9


@pytest.mark.bad_input
def test_load_heads_round_trip_and_refuses_another_backbone(tiny_backbone, tmp_path):
    import dataclasses
    import json

    from safetensors.torch import save_file

    from mtp_train.errors import ConfigError
    from mtp_train.heads.persist import heads_state_dict, load_heads

    cfg = HeadsConfig(type="chained", k=2, draft_vocab=6)
    heads = build_heads(cfg, tiny_backbone, draft_ids=torch.tensor([3, 7, 8, 40, 100, 258]))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_file(heads_state_dict(heads), str(tmp_path / "heads.safetensors"))
    meta = {"heads": dataclasses.asdict(cfg), "backbone": {"hidden_size": 64, "vocab_size": 259,
                                                            "fingerprint": tiny_backbone.fingerprint()}}
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    loaded, _ = load_heads(tmp_path, tiny_backbone)
    for n, t in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[n], t), n
    meta["backbone"]["hidden_size"] = 576
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="hidden_size=576"):
        load_heads(tmp_path, tiny_backbone)


@pytest.mark.bad_input
def test_heads_are_refused_on_another_backbone_of_the_same_shape(tiny_backbone, tmp_path, caplog):
    """Another seed and another name (the issue's case) and other weights under the same name are
    refused naming what differs; the same weights renamed only warn; a heads.json without a
    fingerprint is refused as damaged; allow_foreign_heads loads with a warning."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from mtp_train.backbone import load_backbone
    from mtp_train.config import BackboneConfig, TinyBackboneConfig
    from mtp_train.errors import ConfigError
    from mtp_train.heads.persist import heads_state_dict, load_heads

    cfg = HeadsConfig(type="chained", k=2)
    save_file(heads_state_dict(build_heads(cfg, tiny_backbone)), str(tmp_path / "heads.safetensors"))
    (tmp_path / "heads.json").write_text(json.dumps({"heads": dataclasses.asdict(cfg), "backbone": {
        "name": tiny_backbone.name, "hidden_size": 64, "vocab_size": 259,
        "fingerprint": tiny_backbone.fingerprint()}}))

    def tiny(name, seed):
        return load_backbone(BackboneConfig(name=name, source="tiny", tiny=TinyBackboneConfig(seed=seed)))

    assert tiny("tiny-llama", 0).fingerprint() == tiny_backbone.fingerprint()  # same weights, same print
    load_heads(tmp_path, tiny("tiny-llama", 0))
    other = tiny("other-llama", 1)
    with pytest.raises(ConfigError, match=r"heads.json: heads were trained on another backbone \(named "
                                          r"'tiny-llama', this one is 'other-llama'; weights fingerprint"):
        load_heads(tmp_path, other)
    with pytest.raises(ConfigError, match=r"another backbone \(weights fingerprint \w+, this one's is \w+\)"):
        load_heads(tmp_path, tiny("tiny-llama", 1))
    with caplog.at_level("WARNING", logger="mtp_train"):  # the same weights renamed: a warning only
        load_heads(tmp_path, tiny("renamed", 0))
        assert "trained on these weights under the name 'tiny-llama'" in caplog.text
        heads, _ = load_heads(tmp_path, other, allow_foreign=True)
    assert heads.k == 2 and "loading them anyway" in caplog.text
    meta = json.loads((tmp_path / "heads.json").read_text())
    del meta["backbone"]["fingerprint"]  # a damaged heads.json: refused, not judged by the name
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(MtpError, match=r"heads.json: its 'backbone' record has no weights fingerprint"):
        load_heads(tmp_path, tiny("tiny-llama", 0))


def test_the_fingerprint_does_not_depend_on_the_dtype_or_on_lora_adapters(tiny_backbone, tmp_path):
    import copy

    from safetensors.torch import save_file

    from mtp_train.backbone import file_samples, load_backbone, memory_samples, weights_fingerprint
    from mtp_train.config import BackboneConfig, LoraConfig, TinyBackboneConfig

    half = copy.deepcopy(tiny_backbone)
    half.model.to(torch.bfloat16)  # what a bf16 strategy does to the backbone in place
    half._fingerprint = None
    assert half.fingerprint() == tiny_backbone.fingerprint()
    for over in ({"dtype": "bfloat16"}, {"lora": LoraConfig(enabled=True)}):
        bb = load_backbone(BackboneConfig(name="tiny-llama", source="tiny", tiny=TinyBackboneConfig(), **over))
        assert bb.fingerprint() == tiny_backbone.fingerprint(), over
    # from the files: the stored dtype plays no part
    state = {n: t.clone().contiguous() for n, t in tiny_backbone.model.state_dict().items()}  # untie
    prints = []
    for dtype in (torch.float32, torch.bfloat16):
        d = tmp_path / str(dtype)
        d.mkdir()
        save_file({n: t.to(dtype) for n, t in state.items()}, str(d / "model.safetensors"))
        prints.append(weights_fingerprint(file_samples(d)))
    assert prints[0] == prints[1] == weights_fingerprint(memory_samples(tiny_backbone.model))
    state["model.layers.0.mlp.up_proj.weight"][0, 3] += 0.5  # one sampled weight changed: another print
    save_file(state, str(tmp_path / "model.safetensors"))
    assert weights_fingerprint(file_samples(tmp_path)) != prints[0]


@pytest.mark.parametrize("init", ["copy_last", "random"])
def test_chained_blocks_start_as_the_backbones_last_layer_or_from_random_init(tiny_backbone, init):
    from mtp_train.heads.persist import build_heads

    torch.manual_seed(0)
    heads = build_heads(HeadsConfig(type="chained", k=2, init=init), tiny_backbone)
    last = tiny_backbone.model.base_model.layers[-1].state_dict()
    for block in heads.blocks:
        same = [torch.equal(block.layers[0].state_dict()[n], t) for n, t in last.items() if t.dim() == 2]
        assert same and all(same) == (init == "copy_last") and (any(same) is (init == "copy_last"))


@pytest.mark.bad_input
def test_heads_with_non_finite_weights_are_refused_on_load(tiny_backbone, tmp_path):
    import dataclasses
    import json

    from safetensors.torch import save_file

    from mtp_train.errors import MtpError
    from mtp_train.heads.persist import heads_state_dict, load_heads

    cfg = HeadsConfig(type="medusa", k=2)
    state = heads_state_dict(build_heads(cfg, tiny_backbone))
    name = sorted(n for n, t in state.items() if t.is_floating_point())[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(tmp_path / "heads.safetensors"))
    (tmp_path / "heads.json").write_text(json.dumps({"heads": dataclasses.asdict(cfg), "backbone": {
        "name": tiny_backbone.name, "hidden_size": 64, "vocab_size": 259, "fingerprint": tiny_backbone.fingerprint()}}))
    with pytest.raises(MtpError, match=rf"heads.safetensors: {name} has 1 non-finite values"):
        load_heads(tmp_path, tiny_backbone)


@pytest.mark.bad_input
def test_diverged_heads_are_never_written(tiny_backbone, typed_cfg, tmp_path):
    from mtp_train.errors import MtpError
    from mtp_train.pipeline.training import save_heads

    cfg = typed_cfg("backbone=tiny", "heads.k=2")
    heads = build_heads(cfg.heads, tiny_backbone)
    with torch.no_grad():
        next(p for p in heads.parameters() if p.requires_grad).view(-1)[3] = float("inf")
    with pytest.raises(MtpError, match=r"heads.safetensors: not written, training diverged .*non-finite"):
        save_heads(tmp_path, heads, tiny_backbone, cfg, {})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["heads"].update(colour="red"), r"heads.json: 'heads' has keys this version does not know: colour"),
    (lambda m: m["heads"].update(k=0), r"heads.json: its 'heads' settings are invalid \(heads.k: must be >= 1"),
    (lambda m: m.pop("heads"), r"heads.json: has no 'heads' settings"),
    (lambda m: m.update(backbone=[1]), r"heads.json: has no 'backbone' record"),
])
@pytest.mark.bad_input
def test_a_damaged_heads_json_is_blamed_not_the_command_line(tiny_backbone, tmp_path, edit, message):
    import dataclasses
    import json

    from safetensors.torch import save_file

    from mtp_train.errors import MtpError
    from mtp_train.heads.persist import heads_state_dict, load_heads

    cfg = HeadsConfig(type="medusa", k=2)
    save_file(heads_state_dict(build_heads(cfg, tiny_backbone)), str(tmp_path / "heads.safetensors"))
    meta = {"heads": dataclasses.asdict(cfg), "backbone": {"name": tiny_backbone.name, "hidden_size": 64,
                                                            "vocab_size": 259, "fingerprint": tiny_backbone.fingerprint()}}
    edit(meta)
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(MtpError, match=message):
        load_heads(tmp_path, tiny_backbone)


def test_a_bf16_copy_of_chained_heads_keeps_float32_rotary_frequencies(tiny_backbone):
    heads = build_heads(HeadsConfig(type="chained", k=2), tiny_backbone)
    fp32 = {n: b.clone() for n, b in heads.named_buffers() if n.endswith("inv_freq")}
    half = heads.to(torch.bfloat16)
    assert fp32 and next(half.parameters()).dtype == torch.bfloat16
    for n, b in half.named_buffers():
        if n in fp32:
            assert b.dtype == torch.float32 and torch.equal(b, fp32[n]), n


@pytest.mark.bad_input
@pytest.mark.parametrize("damage, message", [
    ("int32", r"blocks\.0\.\S+ is int32, these heads expect a floating-point tensor"),
    ("shape", r"has shape \[\d+, \d+\], these heads expect \[\d+, \d+\]"),
    ("ids_out_of_range", r"draft_ids holds token id 1000000, outside this backbone's vocabulary \[0, 259\)"),
    ("ids_negative", r"draft_ids holds token id -1, outside"),
    ("ids_duplicated", r"draft_ids is not strictly ascending at index 2 \(7, 7\)"),
    ("ids_float", r"draft_ids must be a 1-D integer tensor"),
    ("k_string", r"heads\.k is '2'; expected int"),
    ("k_bool", r"heads\.k is True; expected int"),
    ("hidden_string", r"backbone\.hidden_size is '64'; expected int"),
])
def test_damaged_heads_files_are_refused_naming_the_tensor_or_key(tiny_backbone, tmp_path, damage, message):
    """What torch or the dataclass would take silently (int32 weights cast to zeros, ids that index
    out of the vocabulary, a k that is a string) is refused in one line naming the tensor or key."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from mtp_train.errors import MtpError
    from mtp_train.heads.persist import heads_state_dict, load_heads

    cfg = HeadsConfig(type="chained", k=2, draft_vocab=6)
    state = heads_state_dict(build_heads(cfg, tiny_backbone, draft_ids=torch.tensor([3, 7, 8, 40, 100, 258])))
    meta = {"heads": dataclasses.asdict(cfg), "backbone": {"hidden_size": 64, "vocab_size": 259,
                                                            "fingerprint": tiny_backbone.fingerprint()}}
    weight = next(n for n, t in state.items() if n.startswith("blocks.0") and t.dim() == 2)
    if damage == "int32":
        state[weight] = (state[weight] * 1000).to(torch.int32)
    elif damage == "shape":
        state[weight] = state[weight][:, :-1].contiguous()
    elif damage.startswith("ids_"):
        state["draft_ids"] = {"ids_out_of_range": torch.tensor([3, 7, 8, 40, 100, 10**6]),
                              "ids_negative": torch.tensor([-1, 7, 8, 40, 100, 258]),
                              "ids_duplicated": torch.tensor([3, 7, 7, 40, 100, 258]),
                              "ids_float": torch.tensor([3.0, 7, 8, 40, 100, 258])}[damage]
    elif damage == "hidden_string":
        meta["backbone"]["hidden_size"] = "64"
    else:
        meta["heads"]["k"] = {"k_string": "2", "k_bool": True}[damage]
    save_file(state, str(tmp_path / "heads.safetensors"))
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(MtpError, match=message):
        load_heads(tmp_path, tiny_backbone)


@pytest.mark.bad_input
@pytest.mark.parametrize("edit, message", [({"k": 2}, r"k is 2 but heads\.k is 3"),
                                           ({"head_type": "medusa"}, r"head_type is 'medusa' but heads\.type is 'chained'")])
def test_heads_json_whose_summary_contradicts_its_settings_is_refused(tiny_backbone, tmp_path, edit, message):
    """heads.json's top-level head_type and k (what the report reads) must match its heads settings
    (what loading builds): an edit that makes them differ is refused by loading and by mtp-report."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from mtp_train.errors import MtpError
    from mtp_train.heads.persist import heads_state_dict, load_heads
    from mtp_train.report import write_report

    cfg = HeadsConfig(type="chained", k=3)
    run = tmp_path / "train"
    run.mkdir()
    save_file(heads_state_dict(build_heads(cfg, tiny_backbone)), str(run / "heads.safetensors"))
    meta = {"heads": dataclasses.asdict(cfg), "head_type": "chained", "k": 3,
            "backbone": {"name": tiny_backbone.name, "hidden_size": 64, "vocab_size": 259,
                         "fingerprint": tiny_backbone.fingerprint()}}
    (run / "heads.json").write_text(json.dumps({**meta, **edit}))
    with pytest.raises(MtpError, match=message):
        load_heads(run, tiny_backbone)
    with pytest.raises(MtpError, match=message):
        write_report(tmp_path)


@pytest.mark.bad_input
def test_heads_changed_after_training_wrote_them_are_refused_and_never_count_as_finished(tiny_backbone, tmp_path):
    """heads.json records the sha256 of heads.safetensors: zeroed or truncated weights are refused by
    loading (eval, clp, export) and a rerun of mtp-train does not skip over them as finished; a
    draft_size that contradicts the file is refused too."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from mtp_train.artifacts import file_sha256
    from mtp_train.errors import MtpError
    from mtp_train.heads.persist import heads_state_dict, load_heads
    from mtp_train.pipeline.rundir import finished_run

    cfg = HeadsConfig(type="chained", k=2, draft_vocab=6)
    state = heads_state_dict(build_heads(cfg, tiny_backbone, draft_ids=torch.tensor([3, 7, 8, 40, 100, 258])))
    save_file(state, str(tmp_path / "heads.safetensors"))
    meta = {"heads": dataclasses.asdict(cfg), "draft_size": 6, "recipe": {"finished": "f1"},
            "weights_sha256": file_sha256(tmp_path / "heads.safetensors"),
            "backbone": {"hidden_size": 64, "vocab_size": 259, "fingerprint": tiny_backbone.fingerprint()}}
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    load_heads(tmp_path, tiny_backbone)
    assert finished_run(tmp_path, "f1") is not None
    save_file({n: torch.zeros_like(t) if t.is_floating_point() else t for n, t in state.items()},
              str(tmp_path / "heads.safetensors"))  # same header, zeroed weights
    for call in (lambda: load_heads(tmp_path, tiny_backbone), lambda: finished_run(tmp_path, "f1")):
        with pytest.raises(MtpError, match=r"heads\.safetensors: its contents changed after training wrote it"):
            call()
    save_file(state, str(tmp_path / "heads.safetensors"))
    (tmp_path / "heads.json").write_text(json.dumps({**meta, "draft_size": 100}))
    with pytest.raises(MtpError, match=r"draft_size is 100, the heads' draft vocabulary holds 6"):
        load_heads(tmp_path, tiny_backbone)
