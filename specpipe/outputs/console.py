"""The short summary table printed at the end of a run."""
from __future__ import annotations

from typing import Optional

from specpipe.config.schema import draft_schema


def sampling_text(sp: Optional[dict]) -> str:
    if not sp:
        return "-"
    from specpipe.stages.verify_sampling import GREEDY_TEMPERATURE

    text = "greedy" if sp["temperature"] < GREEDY_TEMPERATURE else \
        f"temperature {sp['temperature']:g}, top_p {sp['top_p']:g}, top_k {sp['top_k']}"
    if sp.get("min_p", 0.0) > 0 and not text.startswith("greedy"):
        text += f", min_p {sp['min_p']:g}"
    if sp.get("repetition_penalty", 1.0) != 1.0:
        text += f", repetition_penalty {sp['repetition_penalty']:g}"
    text += f" ({sp['source']})" if not sp["source"].startswith("config") else ""
    return text + (f"; {sp['per_request']} request(s) with their own" if sp.get("per_request") else "")


def drafter_title(d) -> str:
    """The drafter and its tree's shape as the title names them (`d`: metrics.json's `config.draft`): its schema's
    label (`config.drafts`), the shape only for a drafter that speculates; the stored label where no schema names
    its `_target_` (a metrics.json older than drafters' classes)."""
    schema = draft_schema(d)
    if schema is None:
        return f"draft={d.get('method')}"
    if not schema.speculates:
        return f"draft={schema.label(d)}"
    return f"draft={schema.label(d)} topk={d['topk']} steps={d['num_steps']} tokens={d['num_draft_tokens']}"


def print_summary(m: dict, out_dir: Optional[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = m["config"]
    t = Table(title=f"specpipe: {drafter_title(c['draft'])}, allocator={c['allocator']['_target_'].rsplit('.', 1)[-1]}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    al = m["accept_length_mean"]
    rows = [
        ("requests (errors)", f"{m['num_requests']} ({m['num_errors']})"),
        *([("  finished before resume", str(m["resumed_requests"]))] if m.get("resumed_requests") else []),
        ("generated tokens", str(m["generated_tokens"])),
        ("wall time", f"{m['wall_s']:.2f} s"),
        ("tokens/s", f"{m['tokens_per_s']:.1f}"),
        ("acceptance length", "-" if al is None else f"{al:.2f}"),
        ("acceptance per position", ", ".join("-" if x is None else f"{x:.2f}"
                                              for x in m["acceptance_rate_per_position"])),
        ("sampling", sampling_text(m.get("sampling"))),
        ("verify steps", str(m["num_verify_steps"])),
        ("recompiles", str(m["recompiles"]) + (f" (recompile limit hit {m['recompile_limit_hits']}x: a compiled "
                                                f"branch ran eager)" if m.get("recompile_limit_hits") else "")),
        ("leaked KV slots", str(m["kv_leaked_slots"])),
    ]
    for k, v in rows:
        t.add_row(k, v)
    sm, mm = m["stage_ms"], m["stage_model_ms"]
    label = "ms per round" if m["num_verify_steps"] else "ms in all"  # no round: totals
    if not sm:  # no stage ran (every request failed before its prefill): no row of nothing
        pass
    elif mm is None:  # model_timing=false: stage times only
        t.add_row(label, ", ".join(f"{k} {v:.2f}" for k, v in sm.items()))
    else:
        t.add_row(f"{label} (model)", ", ".join(f"{k} {v:.2f} ({mm.get(k, 0.0):.2f})" for k, v in sm.items()))
    con = Console()
    con.print(t)
    if m.get("num_errors"):
        shown = m.get("request_errors", [])
        more = m["num_errors"] - len(shown)
        con.print(f"{m['num_errors']} of {m['num_requests']} requests failed"
                  + (" (the rest are in completions.jsonl)" if more > 0 and out_dir else "") + ":", markup=False)
        for e in shown:
            con.print(f"  request {e['index']}: {e['error']}", markup=False, highlight=False)
    if m.get("swa_prefill_chunk_forwards"):
        con.print(f"note: {m['swa_chunked_prefills']} request prefill(s) ran in chunks "
                  f"({m['swa_prefill_chunk_forwards']} target forwards, as few as {m['swa_prefill_chunk_min_tokens']} "
                  "tokens each): the window pool "
                  "could not hold them whole; a larger allocator.swa_num_slots prefills in fewer forwards",
                  markup=False, highlight=False)
    if out_dir:
        con.print(f"outputs: {out_dir}/metrics.json, {out_dir}/completions.jsonl")
