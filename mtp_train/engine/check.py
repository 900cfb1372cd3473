"""`mtp-serve-check RUN`: serve a run's exported heads in a real engine (vLLM's CPU build, env.py)
and hold the engine's own acceptance counters against the decoder's on the same prompts.

What it does, in one process tree that it always takes down again:
1. exports the run's heads in their engine format (eagle3 or medusa) into <out>/export-<format>;
2. starts the engine worker (worker.py) in the engine environment with two engines on the backbone
   the export names: the backbone alone and the backbone with the drafter (greedy, batch 1, fp32);
3. decodes the prompts with the engine with and without the drafter and with our decoder's chain
   (`verify`, the same k and max_new_tokens), interleaved per prompt in a rotating order, in
   `rounds` timing rounds;
4. compares: the engine's outputs with the drafter against its outputs without (lossless inside
   the engine); its mean acceptance length (1 + accepted / drafts, from `vllm:spec_decode_*`) and
   per-position acceptance (accepted at position i / drafts) against ours computed the same way from
   our decoder's steps; tokens/s of all three.

Agreement: |engine tau - ours| <= `tau_tolerance(ours)` and every position within POS_TOLERANCE;
a disagreement names its likely cause (`causes`). Results go to <out>/serve_check.json and, for a
pipeline run, into its report.md (mtp_train/report.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import statistics
import subprocess
import time
from pathlib import Path

from mtp_train.errors import MtpError

log = logging.getLogger(__name__)

# Agreement. The engine and our decoder run the same greedy fp32 chain, so with a faithful export
# their counts agree exactly but for a rare near-tie that rounds the other way (a correct export
# gave 0.0% on SmolLM2 and on the tiny backbone). A tolerance of 5% of tau let auxiliary layer ids
# moved by one pass on SmolLM2 (1.265 vs 1.290: neighbouring layers hold similar states), so the
# rule is relative to what the drafter adds: |engine tau - ours| <= 5% of (ours - 1), at least
# 0.005, and every position within 0.01 (about 7 drafts in 670 on 20 prompts x 48 tokens).
TAU_TOLERANCE = 0.05  # of the acceptance gain, ours_tau - 1
TAU_FLOOR = 0.005
POS_TOLERANCE = 0.01  # absolute, per-position acceptance


def tau_tolerance(ours_tau: float) -> float:
    """How far the engine's mean acceptance length may lie from ours and still agree."""
    return max(TAU_FLOOR, TAU_TOLERANCE * (ours_tau - 1))
SERVE_CHECK = "serve_check.json"
SERVE_CHECK_DIR = "serve_check"  # inside the run directory
ENGINE_LOG = "engine.log"
START_TIMEOUT_S = 900  # building both engines (model load, drafter load, kernel warm-up)
REQUEST_TIMEOUT_S = 600
# the head sizes vLLM's CPU attention has kernels for (0.32.0; others stop the engine at start-up)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# what can be broken in an export on purpose, to show that the comparison catches it (tests, docs)
TAMPERS = ("aux_layers", "norm_before_residual")


# settings of ours that must not reach the engine: our venv's Python paths, and fixed ports or
# addresses (the engine's processes talk over loopback ports they choose free at start-up, so a
# port already in use elsewhere cannot stop them, unless one of these pins it)
_NOT_FOR_THE_ENGINE = ("PYTHON", "VLLM_PORT", "VLLM_HOST_IP", "MASTER_PORT", "MASTER_ADDR")


def engine_environment(spec: dict, base: dict | None = None) -> dict:
    """The environment the engine worker starts with."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(_NOT_FOR_THE_ENGINE)}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(spec.get("kv_gib", 1)), TOKENIZERS_PARALLELISM="false",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    return env


class EngineWorker:
    """The engine worker process (worker.py), talked to over its stdin / stdout, in a process group
    of its own that `close` always takes down (the engine's own worker processes with it)."""

    def __init__(self, python: Path, spec: dict, log_path: Path):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        worker = Path(__file__).with_name("worker.py")
        self.proc = subprocess.Popen([str(python), str(worker), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                     env=engine_environment(spec), start_new_session=True)
        try:
            self.ready = self._read(START_TIMEOUT_S)["ready"]
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None:  # (its children may hold the pipe open after it died)
                break
        self._log.flush()
        state = (f"exited with code {self.proc.poll()}" if self.proc.poll() is not None
                 else f"gave no answer in {timeout:.0f} s")
        raise MtpError(f"the engine {state}; its last lines ({self.log_path}):\n{self.tail()}")

    def ask(self, timeout: float = REQUEST_TIMEOUT_S, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        answer = self._read(timeout)
        if "error" in answer:
            raise MtpError(f"the engine worker refused {req['op']}: {answer['error']}")
        return answer

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        keep = [t for t in text if t.strip()][-lines:]
        return "\n".join(keep)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the engine's own processes share the group
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.5)
        self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def spec_metrics(before: dict, after: dict) -> dict:
    """The engine's speculative-decoding counters over one stretch of work (after - before):
    drafts, draft_tokens, accepted, accepted_per_pos."""
    def get(m, key, default):
        return m.get(f"vllm:spec_decode_{key}", default)

    per_before = list(get(before, "num_accepted_tokens_per_pos", []))
    per_after = list(get(after, "num_accepted_tokens_per_pos", []))
    per_before += [0] * (len(per_after) - len(per_before))
    return {"drafts": get(after, "num_drafts", 0) - get(before, "num_drafts", 0),
            "draft_tokens": get(after, "num_draft_tokens", 0) - get(before, "num_draft_tokens", 0),
            "accepted": get(after, "num_accepted_tokens", 0) - get(before, "num_accepted_tokens", 0),
            "accepted_per_pos": [a - b for a, b in zip(per_after, per_before, strict=True)]}


def acceptance_from_counts(drafts: int, accepted_per_pos: list[int]) -> tuple[float, list[float]]:
    """Mean acceptance length (1 + accepted / drafts) and acceptance per draft position (drafts whose
    position i was accepted / drafts), as vLLM reports them."""
    if drafts <= 0:
        return 1.0, [0.0] * len(accepted_per_pos)
    return 1 + sum(accepted_per_pos) / drafts, [a / drafts for a in accepted_per_pos]


def ours_counts(results: list, k: int) -> tuple[int, list[int]]:
    """Our decoder's steps counted as the engine counts them: (steps that verified drafts, per depth
    the steps that kept a depth-j draft)."""
    drafts = sum(1 for r in results for d in r.drafted if d > 0)
    accepted = [sum(r.accepted[j] for r in results) for j in range(k)]
    return drafts, accepted


def causes(ours_tau: float, engine_tau: float, ours_pos: list[float], engine_pos: list[float],
           heads_aux: list[int] | None, engine_aux: list[int] | None, identical: bool) -> list[str]:
    """The likely reasons for a disagreement, most specific first (empty: they agree)."""
    why = []
    if not identical:
        why.append("the engine's outputs with the drafter differ from its outputs without: its verification "
                   "is not lossless here (an engine bug, or the drafter's config changed the target's settings)")
    tau_off = abs(engine_tau - ours_tau) > tau_tolerance(ours_tau)
    pos_off = any(abs(a - b) > POS_TOLERANCE for a, b in zip(engine_pos, ours_pos, strict=False))
    if not (tau_off or pos_off):
        return why
    if heads_aux is not None and engine_aux is not None and list(engine_aux) != list(heads_aux):
        why.append(f"the engine fused auxiliary layers {tuple(engine_aux)}, the heads were trained on "
                   f"{tuple(heads_aux)}: eagle_aux_hidden_state_layer_ids in the export's config.json is wrong")
    if not tau_off:
        why.append("the same acceptance length, but accepted at other positions: the engine's deeper drafting "
                   "steps differ from ours (the drafter's own states fed back, their RoPE positions)")
    elif engine_tau < ours_tau:
        if engine_tau < 1 + 0.25 * (ours_tau - 1):
            why.append("the engine accepts almost none of the drafts ours accepts: it runs another drafter than "
                       "the one trained (auxiliary layer ids, norm_before_residual, hidden_norm, the draft "
                       "vocabulary's d2t map, RoPE theta, or another backbone served)")
        else:
            why.append("the engine accepts fewer drafts than ours: a partly different drafter (norms, RoPE "
                       "settings) or a different chain (num_speculative_tokens, the drafter reading other "
                       "hidden states than ours after a rejection)")
    else:
        why.append("the engine accepts more drafts than ours: our decoder drafts differently from the engine "
                   "(the states it feeds the drafter after a rejection, or how many drafts a step verifies)")
    return why


AUX_LINE = re.compile(r"auxiliary layers[^(\[]*[(\[]([\d,\s]+)[)\]]", re.I)


def engine_aux_layers(log_text: str) -> list[int] | None:
    """The auxiliary layer ids the engine says it fuses (vLLM logs them when it builds an EAGLE-3 drafter)."""
    found = AUX_LINE.findall(log_text)
    return [int(x) for x in found[-1].replace(" ", "").split(",") if x] if found else None


def check_head_size(config, where: str) -> int:
    """The backbone's attention head size, refused in one line when the engine's CPU attention has no
    kernel for it (the engine would only say so deep in its start-up log)."""
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if size not in CPU_HEAD_SIZES:
        raise MtpError(f"{where}: attention head size {size} (hidden_size {config.hidden_size} / "
                       f"{config.num_attention_heads} heads); the engine's CPU attention supports only "
                       f"{', '.join(map(str, CPU_HEAD_SIZES))}")
    return size


def tamper_export(export_dir: Path, what: str, n_layers: int) -> str:
    """Break an eagle3 export the way users' exports break (for tests and docs): `aux_layers` moves
    every auxiliary layer id by one, `norm_before_residual` flips it. Returns what was done."""
    cfg_file = Path(export_dir) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if what == "aux_layers":
        old = cfg["eagle_aux_hidden_state_layer_ids"]
        new = [(i + 1) % n_layers for i in old]
        cfg["eagle_aux_hidden_state_layer_ids"] = new
        done = f"eagle_aux_hidden_state_layer_ids {old} -> {new}"
    elif what == "norm_before_residual":
        cfg["norm_before_residual"] = not cfg.get("norm_before_residual", False)
        done = f"norm_before_residual -> {cfg['norm_before_residual']}"
    else:
        raise MtpError(f"tamper: {what!r} is not one of {', '.join(TAMPERS)}")
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    return done


def serve_check(run_dir: Path, *, n_prompts: int = 20, max_new_tokens: int = 48, prompt_source: str = "unseen",
                prompts_file: Path | None = None, rounds: int = 1, out: Path | None = None,
                build_env: bool = True, tamper: str | None = None, memory_fraction: float = 0.25) -> dict:
    """Run the check on `run_dir` (trained heads) and return (and write) its serve_check.json."""
    import torch
    from tqdm.auto import tqdm

    from mtp_train.artifacts import write_json_atomic
    from mtp_train.backbone import eos_ids, load_backbone
    from mtp_train.decoding import Decoder
    from mtp_train.engine import env as engine_env
    from mtp_train.evaluation.decode import decode
    from mtp_train.evaluation.machine import cpu_model
    from mtp_train.evaluation.runner import round_order
    from mtp_train.heads.persist import load_heads
    from mtp_train.heads.registry import family
    from mtp_train.pipeline.evaluation import select_prompts
    from mtp_train.pipeline.export import load_recipe
    from mtp_train.pipeline.serving import SERVING_FILE, export_for_engine

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MtpError(f"{run_dir}: no run directory here")
    if rounds < 1 or n_prompts < 1 or max_new_tokens < 1:
        raise MtpError("--rounds, --prompts and --max-new-tokens must each be at least 1")
    flags = engine_env.check_cpu()
    python = engine_env.python()
    if python is None and not build_env:
        raise MtpError(f"the engine environment is not built ({engine_env.env_dir()}); build it with "
                       "`make engine-env` (tens of minutes), or drop --no-build")
    cfg = load_recipe(run_dir)
    fmt = family(cfg.heads.type).engine_format
    if fmt is None:
        raise MtpError(f"{run_dir}: {cfg.heads.type} heads have no engine format: "
                       f"{family(cfg.heads.type).no_engine_format}")
    python = python or engine_env.ensure_env(log=lambda m: log.info("%s", m))
    engine = engine_env.describe(python)
    out = Path(out) if out is not None else run_dir / SERVE_CHECK_DIR
    out.mkdir(parents=True, exist_ok=True)
    export_dir = export_for_engine(run_dir, fmt, out / f"export-{fmt}")
    serving = json.loads((export_dir / SERVING_FILE).read_text())

    backbone = load_backbone(cfg.backbone)
    check_head_size(backbone.config, f"{run_dir}: the backbone")
    heads, heads_meta = load_heads(run_dir, backbone)
    backbone.model.to(torch.float32)
    heads.to(torch.float32)
    tampered = None
    if tamper is not None:
        if fmt != "eagle3":
            raise MtpError(f"tamper: only eagle3 exports can be broken on purpose, not {fmt}")
        tampered = tamper_export(export_dir, tamper, backbone.config.num_hidden_layers)
    cfg.eval.n_prompts, cfg.eval.max_new_tokens = n_prompts, max_new_tokens
    cfg.eval.prompt_source, cfg.eval.prompts = prompt_source, str(prompts_file) if prompts_file else None
    prompts, _ = select_prompts(cfg, backbone)
    eos = eos_ids(backbone.model, backbone.tokenizer)
    k = heads.k
    dec = Decoder(backbone, heads, eos_ids=eos, draft_past_budget=True)  # the engine's way of counting
    spec = {"model": serving["backbone"], "max_tokens": max_new_tokens, "eos": eos,
            "max_model_len": max(map(len, prompts)) + max_new_tokens + k + 16, "memory_fraction": memory_fraction,
            "engines": {"without": {}, "with": {"speculative_config": {
                "method": fmt, "model": str(export_dir.resolve()), "num_speculative_tokens": k}}}}
    log.info("starting %s (%s) on %s: the backbone alone and with the %s drafter (k=%d)", engine["package"],
             engine.get("vllm"), serving["backbone"], fmt, k)
    names = ["ours", "engine_without", "engine_with"]
    first: dict[str, list] = {n: [] for n in names}
    wall = {n: [0.0] * rounds for n in names}
    made = {n: [0] * rounds for n in names}

    with EngineWorker(python, spec, out / ENGINE_LOG) as worker:
        for which in ("without", "with"):  # warm-up: one short decode each, outside the counters
            worker.ask(op="generate", engine=which, prompt=prompts[0])
        decode(dec, prompts[0], min(16, max_new_tokens), "verify")
        before = worker.ask(op="metrics", engine="with")["metrics"]
        bar = tqdm(total=rounds * len(prompts) * len(names), desc="serve-check", unit="run", dynamic_ncols=True)
        for r in range(rounds):
            for i, p in enumerate(prompts):
                for name in round_order(names, i, r):
                    if name == "ours":
                        t0 = time.perf_counter()
                        res = decode(dec, p, max_new_tokens, "verify")
                        secs, toks = time.perf_counter() - t0, res.tokens
                    else:
                        ans = worker.ask(op="generate", engine=name.split("_")[1], prompt=p)
                        res, secs, toks = ans["tokens"], ans["seconds"], ans["tokens"]
                    wall[name][r] += secs
                    made[name][r] += len(toks)
                    if r == 0:
                        first[name].append(res)
                    bar.update(1)
        bar.close()
        after = worker.ask(op="metrics", engine="with")["metrics"]
        counts = spec_metrics(before, after)
    # the counters covered every round: the engine is deterministic (greedy), so per round is 1/rounds
    engine_tau, engine_pos = acceptance_from_counts(counts["drafts"], counts["accepted_per_pos"])
    ours_drafts, ours_acc = ours_counts(first["ours"], k)
    ours_tau, ours_pos = acceptance_from_counts(ours_drafts, ours_acc)
    log_text = (out / ENGINE_LOG).read_text(errors="replace")
    engine_aux = engine_aux_layers(log_text) if fmt == "eagle3" else None
    heads_aux = list(heads.aux_layers) if fmt == "eagle3" else None
    with_out, without_out = first["engine_with"], first["engine_without"]
    identical = with_out == without_out
    ours_out = [r.tokens for r in first["ours"]]

    def rate(name):
        return statistics.median(t / s if s else 0.0 for t, s in zip(made[name], wall[name], strict=True))

    why = causes(ours_tau, engine_tau, ours_pos, engine_pos, heads_aux, engine_aux, identical)
    result = {
        "run": str(run_dir.resolve()), "format": fmt, "k": k, "engine": engine, "cpu": cpu_model(),
        "cpu_flags": sorted(flags), "n_prompts": len(prompts), "n_prompts_asked": n_prompts,
        "max_new_tokens": max_new_tokens, "heads_sha256": heads_meta.get("weights_sha256"),
        "prompt_source": "file" if prompts_file else prompt_source, "rounds": rounds, "dtype": "float32",
        "tampered": tampered,
        "identical": identical,
        "identical_prompts": sum(a == b for a, b in zip(with_out, without_out, strict=True)),
        "engine_matches_ours": sum(a == b for a, b in zip(with_out, ours_out, strict=True)),
        "engine_tau": engine_tau, "ours_tau": ours_tau,
        "engine_accept_per_pos": engine_pos, "ours_accept_per_pos": ours_pos,
        "engine_counts": counts, "ours_counts": {"drafts": ours_drafts, "accepted_per_pos": ours_acc},
        "engine_aux_layers": engine_aux, "heads_aux_layers": heads_aux,
        "tau_tolerance": tau_tolerance(ours_tau), "pos_tolerance": POS_TOLERANCE,
        "agree": not why, "causes": why,
        "engine_tok_s_with_drafter": rate("engine_with"), "engine_tok_s_without": rate("engine_without"),
        "ours_tok_s": rate("ours"),
        "wall_s_rounds": wall,
    }
    write_json_atomic(out / SERVE_CHECK, result)
    return result


def summary_lines(r: dict) -> list[str]:
    """The check in a few lines (the console, report.md)."""
    pos = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = [
        f"{r['engine']['package']} (vllm {r['engine'].get('vllm')}), {r['format']} k={r['k']}, {r['n_prompts']} "
        f"prompts x {r['max_new_tokens']} tokens, greedy, fp32, CPU {r['cpu']}",
        f"lossless in the engine: {'yes' if r['identical'] else 'NO'} ({r['identical_prompts']}/{r['n_prompts']} "
        f"outputs with the drafter equal the engine's without; {r['engine_matches_ours']}/{r['n_prompts']} equal ours)",
        f"mean acceptance length: engine {r['engine_tau']:.3f}, ours {r['ours_tau']:.3f} "
        f"({100 * (r['engine_tau'] / r['ours_tau'] - 1):+.1f}%; tolerance {r['tau_tolerance']:.3f}, "
        f"5% of what the drafter adds)",
        f"acceptance per position: engine {pos(r['engine_accept_per_pos'])}, ours {pos(r['ours_accept_per_pos'])} "
        f"(tolerance {r['pos_tolerance']})",
        f"tokens/s: engine with drafter {r['engine_tok_s_with_drafter']:.1f}, engine without "
        f"{r['engine_tok_s_without']:.1f}, ours {r['ours_tok_s']:.1f}",
    ]
    if r.get("tampered"):
        lines.append(f"export broken on purpose: {r['tampered']}")
    lines.append("agree: yes" if r["agree"] else "agree: NO: " + "; ".join(r["causes"]))
    return lines
