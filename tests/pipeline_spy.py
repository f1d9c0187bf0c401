"""Run specpipe.run.run while watching its pipeline: per-step batch size and Dynamo graph count.

Spies on app.build_pipeline (to keep the pipeline and wrap its step) and app.make_requests (to give
requests different token budgets, so they finish at different steps and others join mid-run).
"""
from __future__ import annotations

from specpipe import run as app
from specpipe.decode.metrics import recompile_count


def run_watched(monkeypatch, cfg, budgets=None, pair=None) -> dict:
    """Returns {"pipe", "sizes", "graphs", "requests", "metrics"}: sizes[i] is the batch of step i,
    graphs[i] the process's Dynamo graph count after it."""
    seen: dict = {"sizes": [], "graphs": [], "graphs_before": recompile_count()}
    make, build = app.make_requests, app.build_pipeline

    def make_requests(*a, **k):
        reqs = make(*a, **k)
        for r, n in zip(reqs, budgets or []):
            r.max_new_tokens = n
        return reqs

    def build_pipeline(*a, **k):
        pipe = build(*a, **k)
        step = pipe.step

        def watched_step():
            seen["sizes"].append(len(pipe.reqs))
            out = step()
            seen["graphs"].append(recompile_count())
            return out

        pipe.step = watched_step
        seen["pipe"] = pipe
        return pipe

    monkeypatch.setattr(app, "make_requests", make_requests)
    monkeypatch.setattr(app, "build_pipeline", build_pipeline)
    out = app.run(cfg, quiet=True, pair=pair)
    seen.update(out)
    return seen
