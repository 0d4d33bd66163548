"""e2e/compare.py's output: the markdown tables and the three PNGs (matplotlib, Agg)."""

from __future__ import annotations

import os

from bench.harness import Row, Timed, agreement, p50_p99
from benchmarks.harness.docs import DOCS


def results_table(rows: list[Row]) -> str:
    done = [r for r in rows if r.run]
    base = done[0]
    lines = [
        f"| | system | tok/s | requests/s | × ({base.key}) | TTFT p50 / p99 (s) | latency p50 / p99 (s) | "
        f"token agreement with ({base.key}) | identical requests |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.run is None:
            lines.append(f"| ({r.key}) | {r.name} | skipped: {r.note} | | | | | | |")
            continue
        share, identical = agreement(r.run.outputs, base.run.outputs)
        lines.append(
            f"| ({r.key}) | {r.name} | {r.tok_s:.1f} | {r.req_s:.2f} | {r.tok_s / base.tok_s:.2f}× | "
            f"{p50_p99(r.run.ttfts)} | {p50_p99(r.run.latencies)} | {share:.1%} | "
            f"{identical}/{len(r.run.outputs)} |")
    return "\n".join(lines)


def agreement_matrix(rows: list[Row]) -> str:
    """Pairwise: share of the column system's tokens the row system reproduces before its first divergence."""
    done = [r for r in rows if r.run]
    lines = ["| | " + " | ".join(f"({r.key})" for r in done) + " |", "|---|" + "---:|" * len(done)]
    for a in done:
        cells = [f"{agreement(a.run.outputs, b.run.outputs)[0]:.1%}" for b in done]
        lines.append(f"| ({a.key}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(sweep: list[tuple[int, Timed]]) -> str:
    first = sweep[0][1]
    first_rate = sum(map(len, first.outputs)) / first.seconds
    lines = ["| max_num_seqs | tok/s | × max_num_seqs=" + str(sweep[0][0]) + " | steps | tokens per step | "
             "latency p50 / p99 (s) |", "|---:|---:|---:|---:|---:|---:|"]
    for seqs, t in sweep:
        tokens = sum(map(len, t.outputs))
        steps = int(t.extra.get("steps", "0")) or 1
        lines.append(f"| {seqs} | {tokens / t.seconds:.1f} | {tokens / t.seconds / first_rate:.2f}× | {steps} | "
                     f"{tokens / steps:.1f} | {p50_p99(t.latencies)} |")
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(rows: list[Row], path: str = os.path.join(DOCS, "e2e_throughput.png")) -> str:
    plt = _pyplot()
    done = [r for r in rows if r.run]
    base = done[0].tok_s
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.4), dpi=120)
    labels = [f"({r.key}) {r.name}" for r in rows]
    values = [r.tok_s for r in rows]
    colors = ["#d62728" if r.key in ("5", "6") else "#7f7f7f" for r in rows]
    bars = ax.barh(labels, values, color=colors)
    for bar, r in zip(bars, rows, strict=True):
        text = f"{r.tok_s:.0f} tok/s  ({r.tok_s / base:.1f}×)" if r.run else "skipped"
        ax.text(bar.get_width() + max(values) * 0.01, bar.get_y() + bar.get_height() / 2, text, va="center",
                fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.4)
    ax.set_xlabel("output tokens per second (higher is better)")
    ax.set_title(f"Same {len(done[0].run.outputs)} requests, greedy, equal CPU threads")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency_cdf(rows: list[Row], path: str = os.path.join(DOCS, "e2e_latency_cdf.png")) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for r in rows:
        if not r.run or not r.run.latencies:
            continue
        xs = sorted(r.run.latencies)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"({r.key}) {r.name}: latency")
        if r.key in ("4", "6") and r.run.ttfts:
            xs = sorted(r.run.ttfts)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", linestyle="--",
                    label=f"({r.key}) {r.name}: time to first token")
    ax.set_xscale("log")
    ax.set_xlabel("seconds from submit (log scale; all requests submitted at once)")
    ax.set_ylabel("share of requests done")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    ax.set_title("Request latency CDF (left is better)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(sweep: list[tuple[int, Timed]], path: str = os.path.join(DOCS, "sweep.png")) -> str:
    plt = _pyplot()
    seqs = [s for s, _ in sweep]
    rates = [sum(map(len, t.outputs)) / t.seconds for _, t in sweep]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(seqs, rates, marker="o", color="#d62728")
    for s, v in zip(seqs, rates, strict=True):
        ax.annotate(f"{v:.0f}", (s, v), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.set_ylim(0, max(rates) * 1.2)
    ax.set_xlabel("max_num_seqs (most sequences in one engine step)")
    ax.set_ylabel("output tokens per second")
    ax.set_title(f"tokenbus engine: throughput vs batch size ({len(sweep[0][1].outputs)} requests)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
