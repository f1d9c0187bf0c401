"""Job folders shared by two jobs of one sweep: the first job to claim a folder runs in it, a later one is
skipped and recorded, and the end of the sweep lists the skipped ones (in the launcher's process)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

COLLIDED: list = []  # this process's sweep: why each job that found its folder taken was skipped


def sweep_id(sweep_dir) -> Optional[str]:
    """This sweep's identity, the same in every job's process (a launcher's workers too): when Hydra saved the
    sweep's multirun.yaml, at its start. None without one."""
    try:
        return str((Path(str(sweep_dir)) / "multirun.yaml").stat().st_mtime_ns)
    except OSError:
        return None


def claim_folder(out_dir, sweep_dir, num: int) -> Optional[str]:
    """None when the job folder out_dir is job `num`'s; else the number of the job of this sweep that claimed it
    first ("?" if unreadable). The claim is a file in the folder, so a launcher's separate worker processes
    (joblib) see each other's; two jobs writing one folder went unnoticed there."""
    sid = sweep_id(sweep_dir)
    if sid is None:
        return None
    folder = Path(str(out_dir))
    claim = folder / f".specpipe_claim_{sid}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        other = ""
        for _ in range(20):  # the claimer writes its number just after creating the file
            try:
                other = claim.read_text().strip()
            except OSError:
                other = ""
            if other:
                break
            time.sleep(0.05)
        return None if other == str(num) else (other or "?")
    except OSError:  # an unwritable folder: the run's own write says so
        return None
    with os.fdopen(fd, "w") as f:
        f.write(str(num))
    for old in folder.glob(".specpipe_claim_*"):  # an earlier sweep's
        if old != claim:
            old.unlink(missing_ok=True)
    return None


def note_collision(sweep_dir, message: str) -> None:
    """Record a skipped job for the end of the sweep, which runs in the launcher's process."""
    sid = sweep_id(sweep_dir)
    if sid is not None:
        try:
            with open(Path(str(sweep_dir)) / f".specpipe_collisions_{sid}", "a", encoding="utf-8") as f:
                f.write(" ".join(message.split()) + "\n")
        except OSError:
            pass


def collisions(sweep_dir) -> list[str]:
    """The skipped jobs' messages `note_collision` recorded in this sweep."""
    sid = sweep_id(sweep_dir)
    try:
        text = (Path(str(sweep_dir)) / f".specpipe_collisions_{sid}").read_text(encoding="utf-8") if sid else ""
    except OSError:
        return []
    return [line for line in text.splitlines() if line]
