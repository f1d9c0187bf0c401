"""The report's plot: acceptance length against tokens/s, one labelled point per finished job."""
from __future__ import annotations

from pathlib import Path

from specpipe.config.schema import is_number
from specpipe.sweep.job_files import finite
from specpipe.sweep.jobs import Job
from specpipe.sweep.tables import fixed_digits

def plot(path: Path, jobs: list[Job], varied: list[str], best: Job) -> None:
    """Acceptance length (y) vs tokens/s (x), one labelled point per finished job, the best starred.

    Jobs over their latency limit are drawn hollow: the best is the fastest of the others.

    Plain decoding (draft=none) has no acceptance length; it commits one token per step, drawn at 1.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [j for j in jobs if j.tps is not None]
    xs = [j.tps for j in done]
    ys = [plotted_acceptance(j.metrics.get("accept_length_mean")) for j in done]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    over = [j.within_limit is False for j in done]
    ax.scatter(xs, ys, s=28, zorder=2, edgecolors="tab:blue", facecolors=["none" if o else "tab:blue" for o in over])
    for j, x, y in zip(done, xs, ys):
        label = "/".join(j.overrides.get(k, "") for k in varied) or j.name
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    best = done.index(best)
    ax.scatter([xs[best]], [ys[best]], s=220, marker="*", color="tab:red", zorder=3,
               label=f"best: job {done[best].name}, {fixed_digits(xs[best], 1)} tokens/s")
    ax.set_xlabel("tokens/s")
    ax.set_ylabel("acceptance length (tokens per verify step)")
    ax.set_title("labels: " + " / ".join(varied) if varied else "one point per job", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plotted_acceptance(v) -> float:
    """A job's acceptance length on the plot: 1 (one token a step, as draft=none) when it has none, or none
    finite (a NaN one left the best job's point and star undrawn)."""
    return float(v) if is_number(v) and finite(v) else 1.0


BATCH_KEY = "workload.batch_size"


def plot_by_batch(path: Path, jobs: list[Job], varied: list[str]) -> None:
    """Tokens/s (y) over batch size (x), one line per combination of the other varied keys (a policy, a drafter):
    where speculation stops paying as the batch grows. Written when the sweep varies workload.batch_size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [k for k in varied if k != BATCH_KEY]
    lines: dict[str, list] = {}
    for j in jobs:
        if j.tps is None:
            continue
        try:
            b = int(j.overrides.get(BATCH_KEY, ""))
        except ValueError:
            continue
        label = "/".join(j.overrides.get(k, "") for k in others) or "all jobs"
        lines.setdefault(label, []).append((b, j.tps))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s")
    ax.set_title("lines: " + " / ".join(others) if others else "tokens/s by batch size", fontsize=9)
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
