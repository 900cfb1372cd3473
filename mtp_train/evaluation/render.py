"""What mtp-eval shows and leaves: the table on the console (with the spread over timing rounds,
the flags and the divergence lines), the speedup / acceptance / verify-cost figures, and
eval_report.json.
"""

from __future__ import annotations

from pathlib import Path

from mtp_train.artifacts import save_figure, write_json_atomic
from mtp_train.layout import (
    ACCEPTANCE_PNG,
    EVAL_REPORT,
    SAMPLING_PNG,
    SPEEDUP_PNG,
    VERIFY_COSTS_PNG,
)


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"decoding, k={report['k']}, step cost {report['step_cost']:.2f}"
              + (f", training sim_tau {report['sim_tau']:.2f}" if report.get("sim_tau") else ""))
    for col in ("mode", "tok/s", "speedup", "tau", "acceptance per depth", "rep", "NLL", "greedy match"):
        t.add_column(col, justify="right" if col != "mode" else "left", no_wrap=col in ("mode", "speedup"))
    for name, m in report["modes"].items():
        acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in (m["acceptance"] or []))
        match = "-" if m["greedy_match_rate"] is None else f"{m['greedy_match_rate']:.2f}"
        t.add_row(name, f"{m['tokens_per_s']:.1f}", format_speedup(m, report["details"].get(name)),
                  f"{m['tau']:.2f}", acceptance or "-", f"{m['repetition_ratio']:.3f}", f"{m['backbone_nll']:.3f}",
                  match)
    console = Console()
    if not console.is_terminal:  # a log file: room for the spread, not rich's 80-column default
        console = Console(width=max(console.width, 120))
    console.print(t)
    if adapted := report.get("backbone_adapted"):
        d = adapted["drift"]
        console.print(f"verified against the LoRA-adapted backbone ({adapted['adapter']}); against the original: "
                      f"greedy answers identical {d['greedy_match_rate']:.2f}, prefix kept {d['prefix_match']:.2f}, "
                      f"the original's NLL {d['original_nll_on_adapted']:.3f} on the adapted answers vs "
                      f"{d['original_nll_on_original']:.3f} on its own", highlight=False, soft_wrap=True)
    if report.get("rounds", 1) > 1:
        console.print(f"speedup: median of {report['rounds']} timing rounds (min-max in brackets)")
    if report.get("sampled"):
        console.print(sampled_table(report))
    for line in report.get("flags") or []:
        console.print(f"[bold red]flag[/]: {line}", highlight=False, soft_wrap=True)
    for line in report.get("divergence") or []:
        console.print(f"[bold yellow]not identical to greedy[/]: {line}", highlight=False, soft_wrap=True)


def by_temperature(report: dict) -> dict[str, dict[float, tuple[dict, dict | None]]]:
    """mode -> {temperature: (entry, details)}: the greedy run at temperature 0 and each sampled run
    (eval.sampling) at its own, for the modes that sampled."""
    runs = report.get("sampled") or {}
    sampled = {n for run in runs.values() for n in run["modes"]}
    out: dict[str, dict] = {}
    for name in [n for n in report["modes"] if n in sampled]:
        out[name] = {0.0: (report["modes"][name], report["details"].get(name))}
    for run in runs.values():
        for name, entry in run["modes"].items():
            out.setdefault(name, {})[run["temperature"]] = (entry, run["details"].get(name))
    return out


def sampled_table(report: dict):
    """The rich table of tau, speedup and NLL per mode and temperature (0 = greedy)."""
    from rich.table import Table

    runs = report["sampled"]
    first = next(iter(runs.values()))
    warp = ", ".join(f"{k} {first[k]}" for k in ("top_k", "top_p", "min_p") if first[k] not in (0, 1.0, None))
    t = Table(title=f"speculative sampling against HF generate(do_sample=True){', ' + warp if warp else ''}; "
                    f"{first['samples_per_prompt']} sample(s) per prompt")
    for col in ("mode", "T", "tau", "speedup", "acceptance per depth", "NLL", "NLL z vs HF"):
        t.add_column(col, justify="right" if col != "mode" else "left", no_wrap=True)
    for name, temps in by_temperature(report).items():
        for temp, (m, d) in sorted(temps.items()):
            acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in (m.get("acceptance") or []))
            z = m.get("nll_z_vs_hf")
            t.add_row(name, f"{temp:g}", f"{m['tau']:.2f}", format_speedup(m, d), acceptance or "-",
                      f"{m['backbone_nll']:.3f}", "-" if z is None else f"{z:+.1f}")
    return t


def format_speedup(mode: dict, details: dict | None) -> str:
    """'1.21x', or '1.21x (1.15-1.30)' with the spread over timing rounds when there were several."""
    text = f"{mode['speedup_vs_hf']:.2f}x"
    spread = (details or {}).get("speedup_spread")
    if spread and len((details or {}).get("speedup_rounds") or []) > 1:
        text += f" ({spread[0]:.2f}-{spread[1]:.2f})"
    return text


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    modes = {n: {**m, **report["details"][n]} for n, m in report["modes"].items()
             if report["details"][n].get("accept_hist")}
    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(report["modes"])
    speed = [report["modes"][n]["speedup_vs_hf"] for n in names]
    spread = [report["details"][n].get("speedup_spread") or [s, s] for n, s in zip(names, speed, strict=True)]
    ax.bar(names, speed, color="tab:blue",  # error bars: min and max over the timing rounds
           yerr=[[max(0.0, s - lo) for s, (lo, _) in zip(speed, spread, strict=True)],
                 [max(0.0, hi - s) for s, (_, hi) in zip(speed, spread, strict=True)]], capsize=3)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup vs HF generate")
    ax.set_title("speedup per mode")
    fig.tight_layout()
    paths.append(out_dir / SPEEDUP_PNG)
    save_figure(fig, paths[-1], dpi=120)
    plt.close(fig)
    k = report["k"]
    if k and modes:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        width = 0.8 / len(modes)
        for i, (n, m) in enumerate(modes.items()):
            xs = [j + i * width for j in range(k + 1)]
            total = max(1, sum(m["accept_hist"]))
            a1.bar(xs, [c / total for c in m["accept_hist"]], width, label=n)
            al = [a if a is not None else 0 for a in m["acceptance"]]
            a2.bar([j + i * width for j in range(k)], al, width, label=n)
        a1.set_xticks([j + 0.4 - width / 2 for j in range(k + 1)], [str(j + 1) for j in range(k + 1)])
        a1.set_xlabel("tokens committed per step")
        a1.set_ylabel("fraction of steps")
        a1.set_title("accepted length")
        a2.set_xticks([j + 0.4 - width / 2 for j in range(k)], [f"d{j + 1}" for j in range(k)])
        a2.set_ylabel("acceptance")
        a2.set_ylim(0, 1)
        a2.set_title("per-depth acceptance")
        a2.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / ACCEPTANCE_PNG)
        save_figure(fig, paths[-1], dpi=120)
        plt.close(fig)
    if report.get("sampled"):
        paths.append(_sampling_plot(report, out_dir / SAMPLING_PNG))
    curve = (report.get("decoder") or {}).get("verify_costs")
    if curve:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        ns = sorted(int(n) for n in curve["costs"])

        def at(table: dict, n: int):
            return table[n] if n in table else table[str(n)]

        cost = [at(curve["costs"], n) for n in ns]
        raw = [at(curve.get("raw") or curve["costs"], n) for n in ns]  # reports before the monotone fit had none
        spread = [at(curve["spread"], n) for n in ns]
        a1.errorbar(ns, raw, yerr=[[max(0.0, c - lo) for c, (lo, _) in zip(raw, spread, strict=True)],
                                   [max(0.0, hi - c) for c, (_, hi) in zip(raw, spread, strict=True)]],
                    fmt="o", capsize=3, label="median ratio (min-max)")
        a1.plot(ns, cost, "-", label="non-decreasing fit (used)")
        a1.legend(fontsize=7)
        a1.set_xscale("log", base=2)
        a1.set_xlabel("tokens in one backbone forward")
        a1.set_ylabel("time / one token")
        a1.set_title(f"verify cost (one token {curve['one_token_ms']:.0f} ms)")
        trees = report["decoder"].get("trees") or {}
        rows = [r for r in trees.get("candidates", []) if r["predicted_tau"] is not None]
        for r in rows:
            chosen = r["label"] == trees.get("static")
            a2.scatter(r["cost"], r["predicted_tau"], color="tab:red" if chosen else "tab:blue", zorder=3)
            a2.annotate(r["label"], (r["cost"], r["predicted_tau"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        a2.set_xlabel("step cost (verify + draft) / one token")
        a2.set_ylabel("predicted tau")
        a2.set_title("candidate trees (red: chosen)")
        for ax in (a1, a2):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / VERIFY_COSTS_PNG)
        save_figure(fig, paths[-1], dpi=120)
        plt.close(fig)
    return paths


def _sampling_plot(report: dict, path: Path) -> Path:
    """tau and speedup vs HF per mode against the temperature (0 = greedy), with the rounds' spread."""
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, temps in by_temperature(report).items():
        if name == "hf_generate":
            continue
        ts = sorted(temps)
        a1.plot(ts, [temps[t][0]["tau"] for t in ts], "o-", label=name)
        speed = [temps[t][0]["speedup_vs_hf"] for t in ts]
        spread = [(temps[t][1] or {}).get("speedup_spread") or [s, s] for t, s in zip(ts, speed, strict=True)]
        a2.errorbar(ts, speed, yerr=[[max(0.0, s - lo) for s, (lo, _) in zip(speed, spread, strict=True)],
                                     [max(0.0, hi - s) for s, (_, hi) in zip(speed, spread, strict=True)]],
                    fmt="o-", capsize=3, label=name)
    a1.set_ylabel("tau (tokens per backbone forward)")
    a2.set_ylabel("speedup vs HF generate")
    a2.axhline(1.0, color="grey", lw=0.8)
    for ax in (a1, a2):
        ax.set_xlabel("temperature (0 = greedy)")
        ax.grid(alpha=0.3)
    a1.set_title("accepted length under sampling")
    a2.set_title("speedup under sampling")
    a2.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def save_report(report: dict, out_dir: Path) -> Path:
    path = Path(out_dir) / EVAL_REPORT
    write_json_atomic(path, report)
    return path
