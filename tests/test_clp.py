"""Span-length predictors: sizes, the decision rule, class weights, saving and refusing a mismatch."""

from __future__ import annotations

import json

import pytest
import torch

from mtp_train.clp import (
    GateMLP,
    LinearCLP,
    SpanPolicy,
    build_predictor,
    class_weights,
    count_parameters,
    held_out_calibration,
    load_predictor,
    save_predictor,
    span_from_probs,
    undo_class_weights,
)
from mtp_train.errors import MtpError
from mtp_train.evaluation.decode import decode
from tests.helpers import ChainScript


@pytest.mark.parametrize("d,k,n", [(1536, 2, 4611), (1536, 4, 7685), (576, 3, 2308)])
def test_the_linear_clp_has_d_times_k_plus_one_plus_k_plus_one_parameters(d, k, n):
    assert count_parameters(LinearCLP(d, k))["total"] == n == d * (k + 1) + (k + 1)
    assert count_parameters(LinearCLP(d, k, use_head_probs=True))["total"] == (d + k) * (k + 1) + (k + 1)


def test_the_gate_baseline_is_about_a_million_parameters():
    n = count_parameters(GateMLP(576, 3))["total"]
    assert 0.97e6 < n < 1.03e6
    assert isinstance(build_predictor("gate", 576, 3), GateMLP)
    with pytest.raises(MtpError, match="clp.kind"):
        build_predictor("tree", 576, 3)


def _slow_rule(p, tau):
    best = 0
    for m in range(len(p)):
        if sum(p[m:]) >= tau - 1e-7:
            best = m
    return best


def test_span_rule_is_the_largest_m_whose_tail_probability_clears_tau():
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.9, 0.05, 0.05, 0.0]])
    for tau in (0.05, 0.1, 0.3, 0.4, 0.5, 0.8, 0.95, 1.0):
        got = span_from_probs(probs, tau).tolist()
        assert got == [_slow_rule(p.tolist(), tau) for p in probs], tau
    assert span_from_probs(probs, 1.0).tolist() == [0, 0, 0]  # tau = 1: only the backbone's token
    assert span_from_probs(probs, 0.3).tolist() == [2, 3, 0]
    g = torch.Generator().manual_seed(0)
    rand = torch.softmax(torch.randn(50, 5, generator=g), -1)
    for tau in torch.linspace(0, 1, 11).tolist():
        assert span_from_probs(rand, tau).tolist() == [_slow_rule(p.tolist(), tau) for p in rand]


def test_class_weights_are_inverse_frequency_with_mean_one():
    labels = torch.tensor([0] * 6 + [1] * 3 + [3] * 1)  # class 2 absent
    w = class_weights(labels, 3)
    assert w[2] == 0
    assert w[0] * 6 == pytest.approx(w[1] * 3) == pytest.approx(w[3] * 1)
    assert w[[0, 1, 3]].mean() == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["clp", "gate"])
def test_undoing_class_weights_divides_each_class_probability_by_its_weight(kind):
    """Reference: p_m = q_m / w_m renormalised, row by row; a class with weight 0 keeps q_m."""
    torch.manual_seed(0)
    pred = build_predictor(kind, 12, 3)
    with torch.no_grad():
        for p in pred.parameters():
            p.normal_(0, 0.5)
    w = torch.tensor([0.2, 1.5, 0.0, 2.3])
    x = torch.randn(20, 12)
    q = torch.softmax(pred(x), -1)
    undo_class_weights(pred, w)
    got = torch.softmax(pred(x), -1)
    for row_q, row_got in zip(q.tolist(), got.tolist(), strict=True):
        raw = [qm / wm if wm > 0 else qm for qm, wm in zip(row_q, w.tolist(), strict=True)]
        assert row_got == pytest.approx([r / sum(raw) for r in raw], rel=1e-4, abs=1e-6)


def test_a_weighted_fit_overstates_long_spans_until_its_weights_are_undone():
    """Features that carry no information: the weighted fit's P(L >= 1) sits near the weighted
    share of the rare classes; undone, it is the observed frequency."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from mtp_train.lit.predictor import SpanFitModule

    g = torch.Generator().manual_seed(0)
    n = 4000
    labels = torch.multinomial(torch.tensor([0.8, 0.12, 0.05, 0.03]), n, replacement=True, generator=g)
    hidden, probs = torch.randn(n, 8, generator=g), torch.zeros(n, 3)
    weights = class_weights(labels, 3)
    torch.manual_seed(0)
    pred = build_predictor("clp", 8, 3)
    data = DataLoader(TensorDataset(hidden, probs, labels), batch_size=256, shuffle=True)
    L.Trainer(max_epochs=15, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu").fit(SpanFitModule(pred, weights, 3e-2), data)
    before = held_out_calibration(pred, hidden, probs, labels)
    undo_class_weights(pred, weights)
    after = held_out_calibration(pred, hidden, probs, labels)
    observed = float((labels >= 1).float().mean())
    assert before["val/p_span1_observed"] == after["val/p_span1_observed"] == pytest.approx(observed)
    assert before["val/p_span1_predicted"] > 0.5 > observed + 0.2  # inverse-frequency weights: ~3/4
    assert after["val/p_span1_predicted"] == pytest.approx(observed, abs=0.03)
    assert after["val/nll"] < before["val/nll"]


@pytest.mark.bad_input
def test_policy_save_load_round_trip_and_mismatches_are_refused(tmp_path):
    torch.manual_seed(0)
    pred = LinearCLP(16, 3, use_head_probs=True)
    save_predictor(tmp_path, pred, {"backbone": "tiny-llama", "threshold": 0.4})
    back, meta = load_predictor(tmp_path, 16, 3, "tiny-llama")
    h, p = torch.randn(16), torch.rand(3)
    assert SpanPolicy(back, 0.4)(h, p) == SpanPolicy(pred, 0.4)(h, p)
    assert meta["parameters"] == count_parameters(pred)["total"] and meta["kind"] == "clp"
    with pytest.raises(MtpError, match="hidden_size=16"):
        load_predictor(tmp_path, 32, 3)
    with pytest.raises(MtpError, match="k=3"):
        load_predictor(tmp_path, 16, 2)
    with pytest.raises(MtpError, match="backbone 'tiny-llama'"):
        load_predictor(tmp_path, 16, 3, "smollm2")


@pytest.mark.bad_input
def test_a_predictor_json_with_another_kind_is_named_in_one_line(tmp_path):
    """hostile round 4: a predictor.json whose kind was swapped (clp <-> gate) built the other network and
    failed with torch's multi-line list of every state_dict key."""
    torch.manual_seed(0)
    save_predictor(tmp_path / "clp", LinearCLP(8, 3), {})
    meta = json.loads((tmp_path / "clp" / "predictor.json").read_text())
    (tmp_path / "clp" / "predictor.json").write_text(json.dumps({**meta, "kind": "gate"}))
    with pytest.raises(MtpError) as e:
        load_predictor(tmp_path / "clp", 8, 3, kind="clp")
    assert "predictor.json: says kind 'gate' where a clp predictor belongs" in str(e.value)
    with pytest.raises(MtpError) as e:  # no kind asked for: the weights do not fit the network it names
        load_predictor(tmp_path / "clp", 8, 3)
    assert "predictor.safetensors: does not fit a gate predictor" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "clp" / "predictor.json").write_text(json.dumps({**meta, "kind": "mlp"}))
    with pytest.raises(MtpError, match="says kind 'mlp' where a clp/gate predictor belongs"):
        load_predictor(tmp_path / "clp", 8, 3)


def _row(threshold: float | None, tau: float, rep: list[float], nll: list[float]) -> dict:
    return {"threshold": threshold, "tau": tau, "tokens_per_s": 10.0, "repetition_per_prompt": rep,
            "backbone_nll_per_prompt": nll, "repetition_ratio": sum(rep) / len(rep), "backbone_nll": sum(nll) / len(nll)}


@pytest.mark.bad_input
def test_pick_threshold_takes_the_longest_steps_within_bounds_and_refuses_when_none():
    from mtp_train.evaluation.calibration import pick_threshold

    greedy = _row(None, 1.0, [0.10, 0.10], [1.0, 1.0])
    # lower threshold: more tokens a step, but repetition and NLL grow by the same on both prompts
    # (no spread, so the standard error is 0); the timings are noise (the fastest measured row is
    # never the one picked)
    rows = [{**_row(t, 1 + 2 * (1 - t), [0.10 + 0.05 * (1 - t)] * 2, [1.0 + 0.3 * (1 - t)] * 2), "tokens_per_s": 30 * t}
            for t in (0.9, 0.8, 0.7, 0.6, 0.5)]
    # repetition bound 0.02 allows 1 - t <= 0.4; NLL bound 0.10 allows 1 - t <= 0.333
    assert pick_threshold(rows, greedy, 0.02, 0.10)["threshold"] == 0.7
    assert pick_threshold(rows, greedy, 0.02, 1.0)["threshold"] == 0.6
    assert pick_threshold(rows, greedy, 0.001, 0.10) is None  # nothing meets the bounds: the caller keeps 1.0
    # equal tau: the more cautious (higher) threshold, whatever the timings say
    flat = [{**r, "tau": 1.5} for r in rows]
    assert pick_threshold(flat, greedy, 0.02, 1.0)["threshold"] == 0.9


def test_the_bounds_hold_for_the_paired_mean_plus_z_standard_errors():
    """Run L's failure: a mean within the bound over a few prompts whose increases spread widely."""
    import math
    import statistics

    from mtp_train.evaluation.calibration import judge, paired_increase, pick_threshold

    greedy = _row(None, 1.0, [0.0, 0.05, 0.10], [0.9, 1.3, 0.7])
    nll = [0.9, 1.3 + 0.27, 0.7 - 0.03]  # increases 0, +0.27, -0.03: mean +0.08, within 0.10
    risky = _row(0.9, 1.4, [0.0, 0.05, 0.10], nll)
    d = [0.0, 0.27, -0.03]  # the obvious reference: mean and standard error of the paired differences
    se = math.sqrt(sum((x - statistics.mean(d)) ** 2 for x in d) / 2) / math.sqrt(3)
    mean, upper = paired_increase(nll, greedy["backbone_nll_per_prompt"], 1.0)
    assert mean == pytest.approx(0.08) and upper == pytest.approx(0.08 + se)
    assert paired_increase(nll, greedy["backbone_nll_per_prompt"], 2.5)[1] == pytest.approx(0.08 + 2.5 * se)
    # the mean alone (z = 0) passes it; one standard error (~0.09) does not
    assert pick_threshold([dict(risky)], greedy, 0.02, 0.10, z=0.0)["threshold"] == 0.9
    assert pick_threshold([dict(risky)], greedy, 0.02, 0.10, z=1.0) is None
    judged = dict(risky)
    assert not judge(judged, greedy, 0.02, 0.10, 1.0)
    assert judged["within_bounds"] is False and judged["nll_increase"] == pytest.approx(0.08)
    assert judged["repetition_increase"] == judged["repetition_increase_upper"] == 0.0
    # paired, not two samples: a constant shift passes at any z even though both sides spread widely
    shifted = _row(0.8, 1.3, [0.0, 0.05, 0.10], [x + 0.05 for x in greedy["backbone_nll_per_prompt"]])
    assert pick_threshold([shifted], greedy, 0.02, 0.10, z=3.0)["threshold"] == 0.8
    # one prompt: no standard error to add
    one = _row(None, 1.0, [0.1], [1.0])
    assert paired_increase([1.05], one["backbone_nll_per_prompt"], 5.0) == pytest.approx((0.05, 0.05))


def test_the_threshold_sweep_stops_after_the_first_threshold_outside_the_bounds(monkeypatch):
    """Decoded from the most cautious threshold down; the ones after a failure are not decoded."""
    import mtp_train.evaluation.calibration as cal

    nll_by_threshold = {0.9: 1.02, 0.8: 1.05, 0.7: 1.2, 0.6: 1.01, 0.5: 1.5}  # 0.6 would pass by noise
    decoded = []

    def fake_measure(decoder, prompts, max_new_tokens, mode, policy=None, bar=None):
        t = None if policy is None else policy.threshold
        decoded.append(t)
        nll = 1.0 if t is None else nll_by_threshold[t]
        return _row(t, 1.0 if t is None else 2 - t, [0.1, 0.1], [nll, nll]), [[1, 2, 3], [4, 5, 6]]

    monkeypatch.setattr(cal, "measure_decode", fake_measure)

    def passes(row, greedy):
        return cal.judge(row, greedy, 0.02, 0.10, 1.0)

    greedy, rows = cal.sweep_thresholds(None, LinearCLP(8, 3), [[1], [2]], [0.6, 0.9, 0.5, 0.8, 0.7], 3,
                                        progress=False, passes=passes)
    assert decoded == [None, 0.9, 0.8, 0.7]
    assert [r["threshold"] for r in rows] == [0.9, 0.8, 0.7] and rows[-1]["stopped_after"] == [0.6, 0.5]
    assert cal.pick_threshold(rows, greedy, 0.02, 0.10)["threshold"] == 0.8
    decoded.clear()  # without `passes`: every threshold, in the order given
    _, rows = cal.sweep_thresholds(None, LinearCLP(8, 3), [[1], [2]], [0.6, 0.9, 0.5, 0.8, 0.7], 3, progress=False)
    assert decoded == [None, 0.6, 0.9, 0.5, 0.8, 0.7] and not any("stopped_after" in r for r in rows)
    assert cal.pick_threshold(rows, greedy, 0.02, 0.10)["threshold"] == 0.6  # the noisy pass, longer steps


class OracleDrafter(ChainScript):
    """Drafts the backbone's true greedy continuation, wrong at the depths where right[j - 1] is False."""

    def __init__(self, backbone, right):
        super().__init__(len(right), backbone.vocab_size)
        self.bb, self.right = backbone, right

    def token(self, j: int) -> int:
        seq = list(self.committed)
        with torch.no_grad():
            for _ in range(j):  # the backbone's own continuation up to depth j
                g = int(self.bb.model(torch.tensor([seq])).logits[0, -1].argmax())
                seq.append(g)
        return g if self.right[j - 1] else (g + 1) % self.bb.vocab_size


@pytest.mark.parametrize("right,label", [([True, False, True], 1), ([True, True, True], 3),
                                         ([False, True, True], 0)])
def test_labels_from_heads_of_known_accuracy_give_the_known_histogram(tiny_backbone, tmp_path, right, label):
    from datasets import load_from_disk

    from mtp_train.data.acceptance import make_labels
    from mtp_train.decoding import Decoder
    from mtp_train.decoding.plans import Chain

    dec = Decoder(tiny_backbone, eos_ids=[], drafter=OracleDrafter(tiny_backbone, right))
    prompts = [[5, 6, 7, 8], [40, 41], [100, 3, 9]]
    m = make_labels(prompts, dec, tmp_path / "labels", 10, 2, {"heads_sha256": "x", "k": 3}, Chain())
    hist = m["label_histogram"]
    assert sum(hist) == m["rows"] > 0 and hist[label] == m["rows"]
    ds = load_from_disk(str(tmp_path / "labels"))
    assert set(ds["label"]) == {label} and len(ds[0]["hidden"]) == 64 and len(ds[0]["head_probs"]) == 3
    assert set(ds["prompt"]) == {0, 1, 2}
    again = make_labels(prompts, dec, tmp_path / "labels", 10, 2, {"heads_sha256": "x", "k": 3}, Chain())
    assert again == m  # up to date: not decoded again


def test_clp_mode_accepting_everything_is_the_fixed_k_unverified_decode(tiny_backbone):
    from mtp_train.decoding import Decoder

    bb, k, new = tiny_backbone, 3, 17
    drafter = OracleDrafter(bb, [True, False, True])
    out = decode(Decoder(bb, eos_ids=[], drafter=drafter), [7, 8, 9], new, "clp", span_policy=lambda h, p: k)
    seq = [7, 8, 9]
    with torch.no_grad():
        seq.append(int(bb.model(torch.tensor([seq])).logits[0, -1].argmax()))
        while len(seq) - 3 < new:  # slow reference: commit k drafts, then the backbone's token
            drafter.begin(torch.tensor(seq), None)
            seq += [drafter.token(j) for j in range(1, min(k, new - (len(seq) - 3) - 1) + 1)]
            seq.append(int(bb.model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out.tokens == seq[3: 3 + new]


def _slow_greedy_path_labels(drafts, ids, greedy, answer):
    """The definition, one position and one depth at a time."""
    T, k = len(drafts), len(drafts[0])
    out = {}
    for p in range(T - k - 1):
        if not all(answer[p + i] for i in range(1, k + 2)) or ids[p + 1] != greedy[p]:
            continue
        m, known = 0, True
        for j in range(1, k + 1):
            if any(ids[p + i] != greedy[p + i - 1] for i in range(1, j + 1)):
                known = False  # draft j's inputs left the greedy path: decoding never drafts this
                break
            if drafts[p][j - 1] != greedy[p + j]:
                break
            m = j
        if known:
            out[p] = m
    return out


@pytest.mark.parametrize("seed", range(5))
def test_greedy_path_labels_match_the_definition_position_by_position(seed):
    from mtp_train.data.acceptance import greedy_path_labels

    g = torch.Generator().manual_seed(seed)
    T, k, V = 200, 3, 5
    greedy = torch.randint(0, V, (T,), generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    follow = torch.rand(T, generator=g) < 0.8  # the text is the backbone's greedy token 80% of the time
    ids[1:] = torch.where(follow[1:], greedy[:-1], ids[1:])
    answer = torch.arange(T) >= 5
    answer[30:33] = False  # a second prompt inside the row
    drafts = torch.where(torch.rand(T, k, generator=g) < 0.7,  # drafts right 70% of the time
                         torch.stack([torch.roll(greedy, -j) for j in range(1, k + 1)], -1),
                         torch.randint(0, V, (T, k), generator=g))
    pos, label = greedy_path_labels(drafts, ids, greedy, answer)
    want = _slow_greedy_path_labels(drafts.tolist(), ids.tolist(), greedy.tolist(), answer.tolist())
    assert dict(zip(pos.tolist(), label.tolist(), strict=True)) == want
    assert set(want.values()) == {0, 1, 2, 3}  # the draws exercise every label


def _labels(tmp_path, n=40, k=3, d=8):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    out = tmp_path / "labels"
    Dataset.from_dict({"hidden": torch.randn(n, d, generator=g).numpy(), "head_probs": torch.rand(n, k, generator=g).numpy(),
                       "label": torch.randint(0, k + 1, (n,), generator=g).numpy(),
                       "prompt": (torch.arange(n) // 5).numpy()}).save_to_disk(str(out))
    return out


@pytest.mark.parametrize("damage,message", [
    ("hidden", r"row 7 has a non-finite hidden state \(1 such rows\)"),
    ("label", r"row 3 has a label outside 0..3 \(1 such rows\)"),
    ("probs", r"row 5 has a head probability outside \[0, 1\]"),
    ("bytes", r"row 10 has a non-finite hidden state \(1 such rows\)"),
])
@pytest.mark.bad_input
def test_damaged_labels_are_refused_naming_the_row_not_fitted(tmp_path, damage, message):
    """The issue's case: bytes overwritten inside the Arrow file used to fit a NaN predictor."""
    from datasets import Dataset, load_from_disk

    from mtp_train.data.acceptance import read_labels

    out = _labels(tmp_path)
    assert len(read_labels(out, 3, 8)[0]) == 40
    if damage == "bytes":  # overwrite one float of row 10's hidden state inside the Arrow file
        import numpy as np

        arrow = next(out.glob("data-*.arrow"))
        blob = arrow.read_bytes()
        row = np.asarray(load_from_disk(str(out))["hidden"][10], dtype=np.float32).tobytes()
        at = blob.find(row)
        assert at >= 0 and blob.count(row) == 1
        arrow.write_bytes(blob[:at] + np.float32("nan").tobytes() + blob[at + 4:])
    else:
        cols = load_from_disk(str(out)).to_dict()
        row, col, value = {"hidden": (7, "hidden", [float("nan")] * 8), "label": (3, "label", 9),
                           "probs": (5, "head_probs", [0.1, 1.5, 0.2])}[damage]
        cols[col][row] = value
        out = tmp_path / "damaged"
        Dataset.from_dict(cols).save_to_disk(str(out))
    with pytest.raises(MtpError, match=message) as err:
        read_labels(out, 3, 8)
    assert str(out) in str(err.value) and "mtp-clp stage=label force=true" in str(err.value)


@pytest.mark.bad_input
def test_a_predictor_with_non_finite_weights_is_never_written_nor_loaded(tmp_path):
    from safetensors.torch import save_file

    pred = LinearCLP(8, 3)
    with torch.no_grad():
        pred.net.weight[1, 2] = float("nan")
    with pytest.raises(MtpError, match=r"predictor.safetensors: not written, the fit diverged: net.weight has 1 non-finite"):
        save_predictor(tmp_path / "p", pred, {"threshold": 1.0})
    assert not (tmp_path / "p").exists()
    good = LinearCLP(8, 3)
    save_predictor(tmp_path / "q", good, {"threshold": 1.0})
    state = {n: t.clone() for n, t in good.state_dict().items()}
    state["net.bias"][0] = float("inf")
    save_file(state, str(tmp_path / "q" / "predictor.safetensors"))
    with pytest.raises(MtpError, match=r"q/predictor.safetensors: net.bias has 1 non-finite values of 4"):
        load_predictor(tmp_path / "q", 8, 3)


def test_a_predictor_without_a_calibrated_threshold_is_refused(tmp_path):
    from mtp_train.errors import MtpError
    from mtp_train.pipeline.evaluation import predictor_threshold

    assert predictor_threshold({"threshold": 0.8}, tmp_path) == 0.8
    with pytest.raises(MtpError, match="no threshold"):
        predictor_threshold({}, tmp_path)


@pytest.mark.bad_input
@pytest.mark.parametrize("value", [7.5, 0, -0.2, "0.8", True, float("inf")])
def test_a_saved_threshold_outside_0_1_is_refused_as_on_the_command_line(value):
    """predictor.json's threshold is held to the rule clp.thresholds is: a probability in (0, 1]."""
    from mtp_train.clp import saved_threshold
    from mtp_train.errors import MtpError

    with pytest.raises(MtpError, match=r"runs/x/predictor\.json: threshold .* is not a probability in \(0, 1\]"):
        saved_threshold({"threshold": value}, "runs/x/predictor.json")
    assert saved_threshold({"threshold": 0.8}) == 0.8 and saved_threshold({"threshold": 1}) == 1.0
    assert saved_threshold({}) is None


@pytest.mark.bad_input
def test_damaged_swapped_or_hand_edited_predictors_are_refused(tmp_path):
    """Predictor weights with flipped exponents (finite), weights copied from another run, and a
    threshold edited in predictor.json were all reused as fitted and calibrated (hostile round 5)."""
    import json
    import shutil

    from mtp_train.clp import calibration_seal, saved_threshold

    torch.manual_seed(0)
    save_predictor(tmp_path / "a", LinearCLP(8, 3), {"backbone": "tiny-llama"})
    save_predictor(tmp_path / "b", LinearCLP(8, 3), {"backbone": "tiny-llama"})
    load_predictor(tmp_path / "a", 8, 3)
    raw = bytearray((tmp_path / "a" / "predictor.safetensors").read_bytes())
    raw[-3] ^= 0x01  # one low mantissa bit of the last value: still finite
    (tmp_path / "a" / "predictor.safetensors").write_bytes(bytes(raw))
    with pytest.raises(MtpError, match=r"a/predictor\.safetensors: not the weights mtp-clp fitted"):
        load_predictor(tmp_path / "a", 8, 3)
    shutil.copy(tmp_path / "b" / "predictor.safetensors", tmp_path / "a" / "predictor.safetensors")
    with pytest.raises(MtpError, match="not the weights mtp-clp fitted"):
        load_predictor(tmp_path / "a", 8, 3)
    # calibration's seal: the record as written passes; a threshold edited by hand does not
    meta = json.loads((tmp_path / "b" / "predictor.json").read_text())
    meta.update(threshold=0.3, calibrated=True, calibration_hash="h")
    meta["seal"] = calibration_seal(meta)
    assert saved_threshold(meta) == 0.3
    with pytest.raises(MtpError, match="changed after mtp-clp calibrated it"):
        saved_threshold({**meta, "threshold": 0.01})
    with pytest.raises(MtpError, match="changed after mtp-clp calibrated it"):
        saved_threshold({**meta, "calibrated": False})


@pytest.mark.bad_input
def test_a_refit_drops_only_predictors_that_say_they_were_fitted_on_other_heads(tmp_path):
    """mtp-clp with clp.kinds=[clp] after new heads removes gate/'s predictor fitted on the old heads;
    it keeps one fitted on these heads, one without a heads digest (mtp-eval accepts it), a file that
    is not a predictor record, and anything else a user put in the folder."""
    from mtp_train.pipeline.clp_run import drop_stale_predictors

    def gate(meta, extra: bool = False):
        d = tmp_path / "gate"
        d.mkdir(exist_ok=True)
        (d / "predictor.json").write_text(json.dumps(meta))
        (d / "predictor.safetensors").write_bytes(b"w")
        if extra:
            (d / "notes.txt").write_text("mine")
        return d

    for kept in ({"heads_sha256": "a" * 64}, {"threshold": 0.5}, [1, 2]):
        d = gate(kept)
        assert drop_stale_predictors(tmp_path, "a" * 64, ["clp"]) == [] and (d / "predictor.safetensors").exists()
    d = gate({"heads_sha256": "b" * 64}, extra=True)
    assert drop_stale_predictors(tmp_path, "a" * 64, ["clp"]) == ["gate"]
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    d = gate({"heads_sha256": "b" * 64})
    (d / "notes.txt").unlink()
    assert drop_stale_predictors(tmp_path, "a" * 64, ["clp"]) == ["gate"] and not d.exists()
    gate({"heads_sha256": "b" * 64})
    assert drop_stale_predictors(tmp_path, "a" * 64, ["clp", "gate"]) == []  # refitted: not this function's


def test_a_calibration_is_redone_for_other_noise_settings_but_not_for_reordered_thresholds(typed_cfg):
    """calibration_key: bound_z and stop_at_failure change what passes; the order of the thresholds
    does not when they are decoded from the highest down anyway."""
    from mtp_train.pipeline.clp_run import calibration_key

    meta, prompts = {"fit_hash": "f", "heads_sha256": "h"}, [[1, 2, 3]]

    def key(*overrides):
        return calibration_key(typed_cfg(*overrides), meta, prompts)

    base = key("clp.thresholds=[0.9,0.8]")
    assert key("clp.thresholds=[0.8,0.9]") == base
    assert key("clp.thresholds=[0.9,0.8]", "clp.bound_z=0") != base
    assert key("clp.thresholds=[0.9,0.8]", "clp.stop_at_failure=false") != base
    # every threshold decoded in the order given: the order is part of the record
    assert (key("clp.thresholds=[0.8,0.9]", "clp.stop_at_failure=false")
            != key("clp.thresholds=[0.9,0.8]", "clp.stop_at_failure=false"))
