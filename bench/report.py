"""The benchmark report: a markdown table, the raw JSON, and a chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def to_markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# cdcd benchmark ({doc['mode']} run, {doc['elapsed_s']} s)",
        "",
        f"Machine: {m['cores']} cores, {m['memory_gb']} GiB, {m['os']}, Python {m['python']}; "
        f"{m['postgres']}; {m['mariadb']}.",
        "",
        *([f"Seconds waited for a quiet machine before each measure: "
           f"{', '.join(f'{k} {v:g}' for k, v in doc['settled_s'].items())}.", ""] if doc.get("settled_s") else []),
        "| measure | cdcd | baseline | baseline figure | ratio | notes |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        if "cdcd" in r:
            ours = f"{_fmt(r['cdcd'])} {r['unit']}"
            notes = [f"{_fmt(r['items'])} items in {_fmt(r['cdcd_seconds'])} s"]
            notes.extend(r.get("notes", []))
            if r.get("peak_rss_mb") is not None:
                notes.append(f"peak RSS {_fmt(r['peak_rss_mb'])} MB")
            if "applied_rate" in r:
                ratio = f", ratio {_fmt(r['applied_ratio'])}" if "applied_ratio" in r else ""
                notes.append(f"{_fmt(r['applied_rate'])} {r['unit']} without Spark start-up "
                             f"({_fmt(r['applied_seconds'])} s in merges{ratio})")
            if "mirror_rows" in r:
                notes = [f"{_fmt(r['cdcd_seconds'])} s with Spark start-up; the mirror: {_fmt(r['mirror_files'])} "
                         f"files; rewritten: {_fmt(r['files_rewritten'])} files, {_fmt(r['rows_copied'])} rows "
                         f"copied, {_fmt(r['deletion_vectors_added'])} deletion vectors; mirror built in "
                         f"{_fmt(r['build_seconds'])} s ({_fmt(r['build_rate'])} events/s in merges)"]
            if "lag_seconds" in r:
                notes.append(f"the last batch applied {_fmt(r['lag_seconds'])} s after the daemon's last checkpoint; "
                             f"{_fmt(r['merges'])} merges")
            if "mariadb_binlog_rate" in r:
                notes.append(f"mariadb-binlog --verbose: {_fmt(r['mariadb_binlog_rate'])} rows/s "
                             f"(ratio {_fmt(r['ratio_to_mariadb_binlog'])})")
        elif "commit_to_landed_s" in r:
            ours = f"{_fmt(r['commit_to_landed_s'])} s commit to last row landed"
            notes = [f"first row {_fmt(r['commit_to_first_s'])} s after the commit; the transaction ran "
                     f"{_fmt(r['transaction_s'])} s; server spill {_fmt(r['spill_bytes'])} bytes "
                     f"({_fmt(r['spill_txns'])} txns), streamed {_fmt(r['stream_bytes'])} bytes "
                     f"({_fmt(r['stream_txns'])} txns); cdcd spool peak {_fmt(r['spool_peak_mb'])} MB; peak RSS "
                     f"{_fmt(r['peak_rss_mb'])} MB; logical_decoding_work_mem {r['logical_decoding_work_mem']}"]
        elif "p50_ms" in r:
            ours = f"p50 {_fmt(r['p50_ms'])} ms, p99 {_fmt(r['p99_ms'])} ms"
            notes = [f"{_fmt(r['events'])} events, {r['config']}"]
            if "achieved_rate" in r:
                notes.append(f"the writer committed {_fmt(r['achieved_rate'])} events/s; max {_fmt(r['max_ms'])} ms; "
                             f"{_fmt(r['batches'])} batches, visible p50 {_fmt(r['batch_after_last_p50_ms'])} ms / "
                             f"p99 {_fmt(r['batch_after_last_p99_ms'])} ms after their last commit; "
                             f"peak RSS {_fmt(r['peak_rss_mb'])} MB")
        else:
            ours = f"{_fmt(r['peak_rss_mb'])} MB"
            rate = r.get("events_per_s") or r.get("rows_per_s")
            notes = [f"at {_fmt(rate)} per s"]
        base = f"{_fmt(r['baseline_rate'])} {r['unit']}" if "baseline_rate" in r else "-"
        lines.append(f"| {r['measure']} | {ours} | {r['baseline']} | {base} | {_fmt(r.get('ratio'))} | "
                     f"{'; '.join(notes)} |")
    return "\n".join(lines) + "\n"


def draw_chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [r for r in doc["results"] if "baseline_rate" in r and r.get("cdcd") is not None]
    latency = [r for r in doc["results"] if "p50_ms" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    short = {"PostgreSQL": "PG", "MariaDB": "Maria", " table": "", ", ": "\n"}
    names = []
    for r in pairs:
        name = r["measure"]
        for long, brief in short.items():
            name = name.replace(long, brief)
        names.append(name)
    xs = range(len(pairs))
    axes[0].bar([x - 0.2 for x in xs], [r["cdcd"] for r in pairs], width=0.4, label="cdcd")
    axes[0].bar([x + 0.2 for x in xs], [r["baseline_rate"] for r in pairs], width=0.4, label="baseline")
    axes[0].set_xticks(list(xs), names, fontsize=8)
    axes[0].set_ylabel("items/s")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[0].set_title("Throughput, cdcd next to the raw tool")
    if latency:
        labels = [f"{r.get('target_rate', 5000) // 1000}k/s" for r in latency]
        lx = range(len(latency))
        axes[1].bar([x - 0.2 for x in lx], [r["p50_ms"] for r in latency], width=0.4, color="tab:green", label="p50")
        axes[1].bar([x + 0.2 for x in lx], [r["p99_ms"] for r in latency], width=0.4, color="tab:red", label="p99")
        axes[1].set_xticks(list(lx), labels)
        axes[1].axhline(50, linestyle="--", color="grey", label="target p99 (20k/s)")
        axes[1].set_ylabel("ms")
        axes[1].legend(fontsize=8)
        axes[1].set_title("Commit to landed, by events/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(doc: dict[str, Any], out: Path, chart_png: Path | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    markdown = to_markdown(doc)
    (out / "latest.md").write_text(markdown)
    (out / "latest.json").write_text(json.dumps(doc, indent=2) + "\n")
    if chart_png is not None:
        draw_chart(doc, chart_png)
    return markdown
