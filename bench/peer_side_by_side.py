"""Our EAGLE-3 trainer against the peer's (speculators 0.9.0's `speculators.train`), on the same rows,
states, draft vocabulary, steps, tokens per step and learning rate, on this CPU; both drafters then
scored by the same validation (agreement per depth, sim_tau) and decoded by our decoder on the same
unseen prompts against HF generate. docs/training.md, "The peer's trainer", has the latest table.

    python bench/peer_side_by_side.py                    # the demo's data and EAGLE-3 cache, 4 epochs
    python bench/peer_side_by_side.py --epochs 8 --out runs/peer8
    python bench/peer_side_by_side.py --peer-optimizer muon    # the peer's own default optimizer
    python bench/peer_side_by_side.py --engine                 # and each drafter served in vLLM's CPU build

Needs `mtp-prep experiment=smollm2_demo stage=all` and `... heads=eagle3 stage=cache` (make demo and
make serve-demo make them) and the reference environment (tests/reference/env.py builds it).

1. our cache -> the peer's data format (mtp_train/data/speculators_format.py), our draft vocabulary;
2. the peer trains --epochs epochs (its unit: packed rows of --total-seq-len tokens = train.batch_size
   x our mean row length, so a step holds as many rows as ours on average), with the architecture our
   heads and the engines share (--no-norm-before-fc --no-norm-output, norm_before_residual as ours),
   AdamW at our train.lr, in bf16 autocast where ours trains in bf16;
3. ours trains the same number of steps (`<out>/ours_steps`), and again for the peer's wall time
   (`<out>/ours_minutes`, train.time_budget_min): equal steps and equal CPU minutes;
4. the peer's checkpoint is read back (`heads.from_speculators`, trainer.max_steps=0): validated by ours;
5. mtp-eval decodes each on the same unseen prompts (`eval.prompt_source=unseen`; verify and tree,
   greedy; HF generate in the same process as the reference);
6. with --engine, each drafter is also served in vLLM's CPU build (mtp-serve-check, mtp_train/engine/)
   on the same unseen prompts: the engine's own mean acceptance length and its tokens/s with the
   drafter over without, and whether its counters agree with our decoder's (needs `make engine-env`).
Writes <out>/peer.{json,md}; a rerun skips what is done (each command's own checks); the peer's
training is reused only for the same command, and other settings in the same --out are an error.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

from mtp_train import layout
from mtp_train.artifacts import write_json_atomic
from mtp_train.cli.common import compose_config

REPO = Path(__file__).resolve().parents[1]


def peer_command(py: Path, verifier: Path, data: Path, summary: dict, cfg, args, save: Path) -> list[str]:
    rows_tokens = summary["train_tokens"] / summary["train_rows"]
    seq = int(round(cfg.train.batch_size * rows_tokens))
    cmd = [str(py), str(REPO / "bench" / "peer_speculators_cpu.py"), "--speculator-type", "eagle3",
           "--verifier-name-or-path", str(verifier), "--data-path", str(data),
           "--target-layer-ids", *map(str, summary["aux_layers"]),
           "--mask-token-id", "0", "--total-seq-len", str(seq), "--num-workers", "0", "--draft-attn-impl", "sdpa",
           "--loss-implementation", "eager", "--on-missing", "raise",
           "--no-norm-before-fc", "--no-norm-output",
           "--norm-before-residual" if cfg.heads.norm_before_residual else "--no-norm-before-residual",
           "--optimizer", args.peer_optimizer, "--lr", str(cfg.train.lr),
           "--hidden-states-dtype", args.peer_dtype, "--train-data-ratio", str(summary["train_data_ratio"]),
           "--ttt-steps", str(cfg.heads.k), "--epochs", str(args.epochs), "--checkpoint-freq", str(args.epochs),
           "--seed", str(cfg.seed), "--no-resume-from-checkpoint", "--save-path", str(save)]
    if summary["draft_vocab_size"]:
        n = summary["draft_vocab_size"]
        cmd += ["--draft-vocab-size", str(n), "--d2t-path", str(data / f"d2t-{n}.npy"),
                "--t2d-path", str(data / f"t2d-{n}.npy")]
    return cmd


def command_changes(old: list[str], new: list[str]) -> list[str]:
    """`--flag old -> new` for each option whose values differ between two peer commands (flags
    present in one only read `(none)`, flags without values `(set)`; the program and script before
    the first flag are `(program)`), or ["the order of the options"] when only that differs."""
    def options(cmd: list[str]) -> dict[str, list[str]]:
        key = "(program)"
        out: dict[str, list[str]] = {key: []}
        for a in cmd:
            if a.startswith("--"):
                key = a
                out[key] = []
            else:
                out[key].append(a)
        return out

    def shown(values: list[str] | None) -> str:
        return "(none)" if values is None else " ".join(values) or "(set)"

    a, b = options(old), options(new)
    changes = [f"{k} {shown(a.get(k))} -> {shown(b.get(k))}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return changes or (["the order of the options"] if old != new else [])


def run_peer(cmd: list[str], save: Path, log: Path) -> dict:
    """The peer's training (skipped when its record says it ran this very command): wall seconds,
    steps. A record of another command (other epochs, optimizer, dtype, data path), or checkpoints
    without a record (an interrupted run), is an error that names the problem: the peer numbers its
    checkpoint folders by epoch and the highest is read as the result, so old ones would pass for
    this run's."""
    record = save / "mtp_bench_record.json"
    if record.is_file():
        done = json.loads(record.read_text())
        if "cmd" not in done:
            raise SystemExit(f"{save}: its record does not say which command trained it (written before the "
                             "bench recorded it): remove that folder or pass another --out")
        changes = command_changes(done["cmd"], cmd)
        if not changes:
            return done
        raise SystemExit(f"{save} holds the peer's training for other settings ({'; '.join(changes)}): "
                         "remove that folder or pass another --out")
    if stale := sorted(str(p.parent) for p in save.glob("*/model.safetensors")):
        raise SystemExit(f"{save} holds checkpoints without a record of what trained them ({', '.join(stale)}; "
                         "an interrupted run?): remove that folder or pass another --out")
    save.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t0
    text = log.read_text(errors="replace")
    if r.returncode != 0:
        raise SystemExit(f"the peer's trainer failed (exit {r.returncode}); its log: {log}\n{text[-3000:]}")
    # its checkpoint folders are numbered by epoch; training_state.json holds the global step
    last = max((p.parent for p in save.glob("*/model.safetensors") if p.parent.name.isdigit()),
               key=lambda p: int(p.name), default=None)
    if last is None or not (last / "training_state.json").is_file():
        raise SystemExit(f"{save}: the peer saved no checkpoint with its training state; its log: {log}")
    # its training loop's own time: per epoch, the longer of its two progress bars (training, then
    # validation) at 100%, "Epoch e 100% ... n/n [ h:mm:ss"
    bars = {}
    for m in re.finditer(r"Epoch (\d+) 100%\S*\s+\S+\s+(\d+)/\2\s+\[\s*(\d+):(\d\d):(\d\d)", text):
        e, n, secs = int(m.group(1)), int(m.group(2)), 3600 * int(m.group(3)) + 60 * int(m.group(4)) + int(m.group(5))
        if n > bars.get(e, (0, 0))[0]:
            bars[e] = (n, secs)
    out = {"wall_s": round(wall, 1), "steps": int(json.loads((last / "training_state.json").read_text())["global_step"]),
           "train_loop_s": sum(s for _, s in bars.values()) or None, "checkpoint": str(last), "cmd": cmd}
    write_json_atomic(record, out)
    return out


def heads_row(name: str, run: Path, eval_report: dict | None, wall_s: float, steps: int | None = None) -> dict:
    meta = json.loads((run / layout.HEADS_META).read_text())
    m, k = meta["metrics"], meta["k"]
    row = {"trainer": name, "steps": steps or (meta["recipe"] or {}).get("steps"), "wall_s": wall_s,
           "precision": ((meta["recipe"] or {}).get("precision") or {}).get("used"),
           "sim_tau": m.get("val/sim_tau"), "sim_tau_t1.0": m.get("val/sim_tau_t1.0"),
           "agree": [m.get(f"val/agree_d{j}") for j in range(1, k + 1)]}
    if eval_report:
        for mode in ("verify", "tree"):
            r = eval_report["modes"].get(mode) or {}
            row[f"{mode}_tau"] = r.get("tau")
            row[f"{mode}_speedup"] = r.get("speedup_vs_hf")
    return row


def engine_columns(result: dict) -> dict:
    """The table's engine columns from a serve_check.json: the engine's mean acceptance length, its
    tokens/s with the drafter over without (the same engine, the same prompts), whether its output
    with the drafter equals its output without on every prompt, and whether its counters agree with
    our decoder's (docs/serving.md)."""
    without = result["engine_tok_s_without"]
    return {"engine_tau": result["engine_tau"], "ours_chain_tau": result["ours_tau"],
            "engine_accept": list(result["engine_accept_per_pos"]),
            "engine_speedup": result["engine_tok_s_with_drafter"] / without if without else None,
            "engine_lossless": bool(result["identical"]), "engine_agree": bool(result["agree"])}


def engine_result(run: Path, n_prompts: int, max_new_tokens: int, rounds: int) -> dict:
    """The run's drafter served in the engine: its serve_check.json where one with these settings was
    made on the heads the run holds now (the weights' sha256 heads.json records: a rerun skips it,
    retrained heads are checked again), else mtp-serve-check's check, run now."""
    from mtp_train.artifacts import read_json
    from mtp_train.engine.check import SERVE_CHECK, SERVE_CHECK_DIR, serve_check

    r = read_json(run / SERVE_CHECK_DIR / SERVE_CHECK) or {}
    heads_sha = (read_json(run / layout.HEADS_META) or {}).get("weights_sha256")
    # n_prompts_asked, not n_prompts: the source may hold fewer unseen prompts than were asked for
    if heads_sha and [r.get(k) for k in ("heads_sha256", "prompt_source", "n_prompts_asked", "max_new_tokens",
                                         "rounds", "tampered")] == [heads_sha, "unseen", n_prompts, max_new_tokens, rounds, None]:
        return r
    return serve_check(run, n_prompts=n_prompts, max_new_tokens=max_new_tokens, prompt_source="unseen",
                       rounds=rounds)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/peer")
    ap.add_argument("--epochs", type=int, default=4, help="the peer's epochs (ours then trains its steps)")
    ap.add_argument("--peer-optimizer", default="adamw", choices=["adamw", "muon"])
    ap.add_argument("--peer-dtype", default=None, help="its --hidden-states-dtype (default: what ours trains in)")
    ap.add_argument("--no-decode", action="store_true", help="validation only")
    ap.add_argument("--engine", action="store_true",
                    help="also serve each drafter in vLLM's CPU build on the same unseen prompts (mtp-serve-check)")
    ap.add_argument("--engine-rounds", type=int, default=1, help="the engine check's timing rounds")
    args, overrides = ap.parse_known_args(argv)

    from mtp_train.backbone import load_backbone
    from mtp_train.data.prepared import load_splits, open_cache
    from mtp_train.data.speculators_format import final_norm_weight, write_speculators_data
    from mtp_train.evaluation.machine import cpu_line
    from mtp_train.heads.persist import load_heads
    from mtp_train.pipeline.evaluation import run_eval
    from mtp_train.pipeline.serving import backbone_for_serving
    from mtp_train.pipeline.training import run_train
    sys.path.insert(0, str(REPO))  # the reference environment's builder lives with the tests
    from tests.reference import env

    out = Path(args.out).resolve()
    base = ["experiment=smollm2_demo", "heads=eagle3", "logger=csv", *overrides]
    compose = lambda *o: compose_config([*base, *o])  # noqa: E731
    cfg = compose(f"paths.output_dir={out}/probe")
    backbone = load_backbone(cfg.backbone)
    cache = open_cache(cfg, backbone)
    if cache is None:
        raise SystemExit("no EAGLE-3 cache for the demo's data: run `mtp-prep experiment=smollm2_demo heads=eagle3 "
                         "stage=cache` first")

    # the draft vocabulary both use: ours, counted on the training rows
    from mtp_train.pipeline.training import draft_vocab_for

    draft_ids = draft_vocab_for(cfg, backbone)
    data = out / "peer_data"
    splits = load_splits(layout.data_dirs(cfg))
    if not (data / "mtp_train_source.json").is_file():
        write_speculators_data(cache, splits, final_norm_weight(backbone), data, draft_ids, backbone.vocab_size)
    summary = json.loads((data / "mtp_train_source.json").read_text())
    summary["train_tokens"] = int(cache.lengths("train").sum())

    # the peer in bf16 autocast where the CPU has native bf16 (ours: trainer.precision=auto, which
    # chose bf16 on such a CPU; the table prints what each used)
    if args.peer_dtype is None:
        from mtp_train.backbone import cpu_has_native_bf16

        args.peer_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    cmd = peer_command(env.python(), backbone_for_serving(cfg.backbone), data, summary, cfg, args, out / "peer")
    print("peer:", " ".join(cmd), flush=True)
    peer = run_peer(cmd, out / "peer", out / "peer.log")
    print(f"peer: {peer['steps']} steps in {peer['wall_s']:.0f} s", flush=True)

    # ours: the same steps, then the peer's minutes
    vci = f"trainer.val_check_interval={peer['steps']}"
    runs = {"ours_steps": compose(f"trainer.max_steps={peer['steps']}", vci, f"paths.output_dir={out}/ours_steps"),
            # equal training minutes: our time budget is the peer's training loop (its progress bars)
            "ours_minutes": compose(f"train.time_budget_min={(peer['train_loop_s'] or peer['wall_s']) / 60:.2f}",
                                    "train.min_steps=10",
                                    "trainer.max_steps=100000", vci, f"paths.output_dir={out}/ours_minutes"),
            "peer": compose(f"heads.from_speculators={peer['checkpoint']}", "trainer.max_steps=0",
                            f"paths.output_dir={out}/peer_heads")}
    walls = {}
    for name, c in runs.items():
        t0 = time.time()
        run_train(c)
        meta = json.loads((Path(c.paths.output_dir) / layout.HEADS_META).read_text())
        walls[name] = peer["wall_s"] if name == "peer" else (meta["run"]["elapsed_s"] or round(time.time() - t0, 1))
    # both share the draft vocabulary: the same draft ids
    _, _ = load_heads(out / "peer_heads", backbone)

    rows = []
    for name, c in runs.items():
        report = None
        if not args.no_decode:
            ev = compose(f"eval.train_run={c.paths.output_dir}", "eval.modes=[verify,tree]", "eval.prompt_source=unseen",
                         "eval.sampling.temperatures=[]", f"paths.output_dir={c.paths.output_dir}/eval")
            report = run_eval(ev)
        rows.append(heads_row({"ours_steps": "ours, equal steps", "ours_minutes": "ours, equal minutes",
                               "peer": f"speculators.train ({args.peer_optimizer})"}[name],
                              Path(c.paths.output_dir), report, walls[name],
                              peer["steps"] if name == "peer" else None))
        if args.engine:  # the decodes above and the engine's share the prompts: the eval's count and length
            served = engine_result(Path(c.paths.output_dir), c.eval.n_prompts, c.eval.max_new_tokens,
                                   args.engine_rounds)
            rows[-1].update(engine_columns(served))
    fmt = lambda x, p=3: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"  # noqa: E731
    lines = [f"CPU: {cpu_line()}", f"data: {summary['train_rows']} training rows ({summary['train_tokens']:,} tokens), "
             f"draft vocabulary {summary['draft_vocab_size']}, peer: {args.epochs} epochs, {args.peer_dtype}", "",
             "| trainer | precision | steps | wall | val agree d1/d2/d3 | val sim_tau | verify tau | verify vs HF | "
             "tree tau | tree vs HF |", "|---|---|---|---|---|---|---|---|---|---|"]
    if args.engine:
        lines[-2] += " engine tau | engine accepted per position | engine with / without drafter | lossless, agrees |"
        lines[-1] += "---|---|---|---|"
    rows[-1]["precision"] = f"{args.peer_dtype} autocast"
    for r in rows:
        lines.append(f"| {r['trainer']} | {r['precision']} | {r['steps']} | {r['wall_s']:.0f} s | {' / '.join(fmt(a) for a in r['agree'])} | "
                     f"{fmt(r['sim_tau'])} | {fmt(r.get('verify_tau'), 2)} | {fmt(r.get('verify_speedup'), 2)}x | "
                     f"{fmt(r.get('tree_tau'), 2)} | {fmt(r.get('tree_speedup'), 2)}x |")
        if args.engine:
            lines[-1] += (f" {fmt(r['engine_tau'])} | {' / '.join(fmt(a) for a in r['engine_accept'])} | "
                          f"{fmt(r['engine_speedup'], 2)}x | {'yes' if r['engine_lossless'] else 'NO'}, "
                          f"{'yes' if r['engine_agree'] else 'NO'} |")
    (out / "peer.json").write_text(json.dumps({"rows": rows, "peer": peer, "summary": summary, "cpu": cpu_line(),
                                               "command": cmd}, indent=1))
    (out / "peer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    sys.exit(main(sys.argv[1:]))
