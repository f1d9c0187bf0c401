"""Notes go through `logging`: bare on the console's stderr, once, and into the Hydra job's .log file."""
import logging
import subprocess
import sys
from pathlib import Path

from specpipe.notes import StderrHandler, console_handler, logger

ROOT = Path(__file__).resolve().parents[1]


def test_a_note_reaches_stderr_bare_and_the_loggers_handlers(capsys, caplog):
    log = logger("specpipe.some_module")
    with caplog.at_level(logging.INFO, logger="specpipe"):
        log.info("specpipe: note: 100% of this is a note")  # a '%' in a message with no args stays as it is
    assert capsys.readouterr().err == "specpipe: note: 100% of this is a note\n"
    assert [r.name for r in caplog.records] == ["specpipe.some_module"]


def test_the_console_handler_is_added_once():
    console_handler()
    console_handler()
    logger("specpipe.other")
    assert sum(isinstance(h, StderrHandler) for h in logging.getLogger("specpipe").handlers) == 1


def test_a_cli_note_is_on_stderr_once_and_in_the_jobs_log_file(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "specpipe", "model=random_tiny", "workload.num_prompts=1",
                        "workload.max_new_tokens=2", "draft=none", "draft.path=/nowhere", f"hydra.run.dir={run_dir}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    note = "specpipe: note: draft.path=/nowhere is not read"
    assert p.stderr.count(note) == 1 and note not in p.stdout  # Hydra's own console handler is off
    log_file = run_dir / "__main__.log"
    assert note in log_file.read_text() and "[specpipe.run][INFO]" in log_file.read_text()
