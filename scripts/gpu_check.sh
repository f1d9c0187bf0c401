#!/usr/bin/env bash
# One-command check of the CUDA path on a bare GPU machine (PyTorch installed, no network), issue #48:
# the `cuda` tests, the Triton allocator tests on CUDA tensors, then a small grid (draft=none vs eagle x compile
# presets x allocator token/paged). Each step runs under its own timeout; the whole stays under BUDGET_S (450 s).
# Writes $OUT/summary.md (the table), $OUT/summary.json, $OUT/steps.tsv, $OUT/logs/*.log, $OUT/grid/*/metrics.json.
#
#   scripts/gpu_check.sh                # on the GPU machine, from the repo root
#   QUICK=1 scripts/gpu_check.sh        # a rerun: a subset of the tests and the grid (~3 min)
#   DRY=1 scripts/gpu_check.sh          # anywhere: print every step; run its CPU-side parts (wheels, imports,
#                                       # test collection, every grid point composed and validated, the summary)
#   scripts/gpu_check.sh fetch-wheels   # on a machine with network: fill .whl/ (gitignored) with the wheels
#
# The project goes on PYTHONPATH and is never pip-installed there: its pins (torch==2.13.0 CPU) would pull
# another torch. Its pure-Python dependencies come from .whl/, unzipped into $SITE (no pip needed): Hydra,
# OmegaConf, antlr4 4.9.3 (built into a wheel by fetch-wheels: PyPI has only its sdist), rich and its parts, and
# pytest + hypothesis for the tests. numpy, PyYAML and jinja2 usually come with a PyTorch image; if the import
# check names one missing, FETCH_COMPILED=1 fetch-wheels adds numpy and PyYAML for PYVER (default: this python's).
# tokenizers and safetensors (compiled) are only needed for real HF models, which the grid does not use.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$REPO/build/gpu_check}"
WHL="${WHL:-$REPO/.whl}"
SITE="${SITE:-${TMPDIR:-/tmp}/specpipe-gpu-site}"
DRY="${DRY:-0}"
QUICK="${QUICK:-0}"
BUDGET_S="${BUDGET_S:-450}"
# a model big enough that the GPU, not Python, sets the pace of a forward; byte vocabulary (random_tiny's)
MODEL="${MODEL:-model=random_tiny model.hidden_size=512 model.num_layers=4 model.num_heads=8 model.num_kv_heads=4 model.intermediate_size=1536}"
WORKLOAD="${WORKLOAD:-workload.num_prompts=16 workload.max_new_tokens=64 workload.batch_size=8}"
PURE_WHEELS="hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 rich==15.0.0 markdown-it-py==4.3.0
  mdurl==0.1.2 pygments==2.21.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 hypothesis==6.155.2
  attrs==26.1.0 sortedcontainers==2.4.0 exceptiongroup==1.3.0 tomli==2.2.1"
if [ "$QUICK" = 1 ]; then
  DRAFTS="${DRAFTS:-none eagle}"; PRESETS="${PRESETS:-eager graph}"; ALLOCATORS="${ALLOCATORS:-paged}"
  TESTS_K="${TESTS_K:-graph_capture or triton or (greedy and graph) or timing}"; TEST_TIMEOUT=150; GRID_TIMEOUT=45
else
  DRAFTS="${DRAFTS:-none eagle}"; PRESETS="${PRESETS:-eager graph auto rounds}"; ALLOCATORS="${ALLOCATORS:-token paged}"
  TESTS_K="${TESTS_K:-}"; TEST_TIMEOUT=240; GRID_TIMEOUT=60
fi

if [ "${1:-}" = fetch-wheels ]; then  # (network) pure-Python wheels; sdists (antlr4) are built into wheels
  mkdir -p "$WHL"
  # shellcheck disable=SC2086
  "$PY" -m pip wheel --no-deps -w "$WHL" $PURE_WHEELS || exit 1
  if [ "${FETCH_COMPILED:-0}" = 1 ]; then
    PYVER="${PYVER:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')}"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
      --platform manylinux2014_x86_64 -d "$WHL" numpy==2.4.6 PyYAML==6.0.4 || exit 1
  fi
  ls "$WHL"; exit 0
fi

START=$(date +%s)
mkdir -p "$OUT/logs" "$OUT/grid"
: > "$OUT/steps.tsv"
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$REPO/build/inductor-cache}"
export PYTHONDONTWRITEBYTECODE=1
cd "$REPO" || exit 1

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME TIMEOUT CMD...: run CMD under `timeout`, logged to $OUT/logs/NAME.log; a row in steps.tsv either way
step() {
  local name="$1" limit="$2"; shift 2
  local remain; remain=$(left)
  if [ "$DRY" = 1 ]; then
    printf '[dry] %-28s timeout %3ss: %s\n' "$name" "$limit" "${*@Q}"
    printf '%s\tdry\t0\t%s\n' "$name" "$limit" >> "$OUT/steps.tsv"; return 0
  fi
  if [ "$remain" -lt 20 ]; then
    echo "skip  $name (the ${BUDGET_S}s budget is spent)"; printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$OUT/steps.tsv"
    return 0
  fi
  [ "$limit" -gt "$remain" ] && limit=$remain
  local t0 rc; t0=$(date +%s)
  echo "run   $name (timeout ${limit}s): ${*@Q}"
  timeout -k 10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1; rc=$?
  local status=ok; [ $rc -ne 0 ] && status="rc=$rc"; [ $rc -eq 124 ] || [ $rc -eq 137 ] && status=timeout
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$limit" >> "$OUT/steps.tsv"
  echo "      $status in $(( $(date +%s) - t0 ))s"; [ $rc -ne 0 ] && tail -n 15 "$OUT/logs/$name.log"
  return 0
}

# 1. the wheels, unzipped (a wheel is a zip; pure-Python ones need no pip), and what the machine is
if ls "$WHL"/*.whl > /dev/null 2>&1; then
  mkdir -p "$SITE"
  for w in "$WHL"/*.whl; do "$PY" -m zipfile -e "$w" "$SITE" || echo "cannot unzip $w"; done
  echo "wheels: $(ls "$WHL"/*.whl | wc -l) from $WHL unzipped into $SITE"
else
  echo "wheels: none in $WHL (fill it where there is network: scripts/gpu_check.sh fetch-wheels); using what is installed"
fi
{ echo "date: $(date -u +%FT%TZ)  QUICK=$QUICK DRY=$DRY"; command -v nvidia-smi > /dev/null && nvidia-smi -L
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
"gpus", torch.cuda.device_count(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))'
} > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"

# 2. imports: every module a run and the tests need (CPU-side: runs in DRY too)
"$PY" - <<'PY' 2>&1 | tee "$OUT/logs/imports.log"
import importlib
missing = []
for m in ("torch", "numpy", "yaml", "jinja2", "hydra", "omegaconf", "antlr4", "rich", "pytest", "hypothesis", "triton",
          "specpipe.run", "specpipe.devices.cuda", "specpipe.allocators.kernels_triton"):
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 - name every missing one
        missing.append(f"{m} ({type(e).__name__}: {e})")
print("imports: ok" if not missing else "imports: MISSING " + "; ".join(missing))
PY
if [ "$DRY" != 1 ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA GPU visible to torch: nothing to check here (DRY=1 shows the steps)"; exit 2
fi

# 3. the cuda tests and the Triton allocator tests on CUDA tensors
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rs)  # (no -x: a first GPU run should show every failure)
if [ "$DRY" = 1 ]; then  # CPU-side: the selection collects
  "${PYTEST[@]}" -m cuda --collect-only tests/devices/test_cuda.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -n 2
fi
step cuda-tests "$TEST_TIMEOUT" "${PYTEST[@]}" -m cuda tests/devices/test_cuda.py ${TESTS_K:+-k "$TESTS_K"} \
  --junitxml="$OUT/cuda-tests.xml"
step triton-allocator-tests 90 "${PYTEST[@]}" tests/allocators/test_kernels.py tests/allocators/test_paged.py \
  -k "triton or Triton" --junitxml="$OUT/triton-tests.xml"

# 4. the grid: one run per point, its metrics.json in $OUT/grid/<point>/
POINTS=()
for d in $DRAFTS; do for p in $PRESETS; do for a in $ALLOCATORS; do POINTS+=("draft=$d compile=$p allocator=$a"); done
done; done
if [ "$DRY" = 1 ]; then  # CPU-side: every point composes and validates (device=cuda is not built)
  # shellcheck disable=SC2086
  "$PY" - "${POINTS[@]}" <<PY || echo "grid: a point does not validate"
import sys
from specpipe.config.compose import compose_config
from specpipe.config.validate import validate
for point in sys.argv[1:]:
    validate(compose_config(["device=cuda", *"$MODEL $WORKLOAD".split(), *point.split()]))
print(f"grid: {len(sys.argv) - 1} points compose and validate")
PY
fi
for point in "${POINTS[@]}"; do
  name=$(echo "$point" | sed 's/draft=//; s/ compile=/-/; s/ allocator=/-/')
  # shellcheck disable=SC2086
  step "grid-$name" "$GRID_TIMEOUT" "$PY" -m specpipe device=cuda $MODEL $WORKLOAD $point \
    "hydra.run.dir=$OUT/grid/$name"
done

# 5. the summary: steps and the grid's metrics
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line]
rows, table = [], ["| step | status | s | tokens/s | accept len | recompiles | model ms/step | peak GPU MiB |",
                   "|---|---|---:|---:|---:|---:|---:|---:|"]
for name, status, secs, _ in steps:
    m = {}
    p = out / "grid" / name.removeprefix("grid-") / "metrics.json"
    if name.startswith("grid-") and p.exists():
        m = json.loads(p.read_text())
    mem = (m.get("device_memory") or {}).get("peak_allocated_bytes")
    model = m.get("stage_model_ms")
    row = {"step": name, "status": status, "seconds": int(secs), "tokens_per_s": m.get("tokens_per_s"),
           "accept_length_mean": m.get("accept_length_mean"), "recompiles": m.get("recompiles"),
           "model_ms_per_step": sum(model.values()) if model else None, "peak_gpu_bytes": mem}
    rows.append(row)
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    table.append(f"| {name} | {status} | {secs} | {f(row['tokens_per_s'], '.1f')} | "
                 f"{f(row['accept_length_mean'], '.2f')} | {f(row['recompiles'], 'd')} | "
                 f"{f(row['model_ms_per_step'], '.2f')} | {f(mem and mem / 2**20, '.0f')} |")
(out / "summary.json").write_text(json.dumps(rows, indent=1))
(out / "summary.md").write_text("\n".join(table) + "\n")
print("\n".join(table))
PY
echo "gpu_check: $(( $(date +%s) - START ))s; results in $OUT"
