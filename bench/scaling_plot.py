"""Draws docs/scaling.png from docs/scaling.csv (bench/scaling.sh): tokens/s and peak memory per
rank against model size, one line per ZeRO stage. Configurations that do not fit are drawn at
their estimated memory with hollow markers, above the per-rank budget line, and have no speed.
Usage: scaling_plot.py CSV PNG TITLE"""
import csv
import sys

import matplotlib.pyplot as plt

csv_path, png_path, title = sys.argv[1], sys.argv[2], sys.argv[3]
rows = list(csv.DictReader(open(csv_path)))
gib = 2**30
fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.8))
colors = {"0": "tab:red", "1": "tab:orange", "2": "tab:green", "3": "tab:blue"}
for stage in sorted({r["stage"] for r in rows}):
    mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: int(r["parameters"]))
    ran = [r for r in mine if r["fits"] == "true"]
    label = f"stage {stage}"
    if ran:
        x = [int(r["parameters"]) / 1e6 for r in ran]
        speed.plot(x, [float(r["tokens_per_second"]) for r in ran], "o-", color=colors.get(stage), label=label)
        memory.plot(x, [int(r["peak_rss_bytes"]) / gib for r in ran], "o-", color=colors.get(stage), label=label)
    # Estimated memory of every configuration, measured or not: dashed, hollow where it did not fit.
    memory.plot([int(r["parameters"]) / 1e6 for r in mine], [int(r["estimate_bytes"]) / gib for r in mine], "--",
                color=colors.get(stage), alpha=0.5)
    skipped = [r for r in mine if r["fits"] != "true"]
    if skipped:
        memory.plot([int(r["parameters"]) / 1e6 for r in skipped], [int(r["estimate_bytes"]) / gib for r in skipped],
                    "o", mfc="none", color=colors.get(stage), label=f"stage {stage}: estimate, does not fit")
budget = title.rsplit("budget ", 1)[-1].split(" MiB")[0]
if budget.isdigit():
    memory.axhline(int(budget) / 1024, color="black", linewidth=1, linestyle=":")
    memory.annotate("memory per rank (90% of the machine / 2)", (0.02, int(budget) / 1024), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(0, 4), fontsize=8)
for ax, ylabel in ((speed, "tokens/s (2 ranks)"), (memory, "peak RSS per rank (GiB)")):
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters (millions)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
speed.set_yscale("log")
speed.legend(fontsize=8)
memory.legend(fontsize=7)
fig.suptitle(title, fontsize=9)
fig.tight_layout()
fig.savefig(png_path, dpi=110)
print(f"wrote {png_path}")
