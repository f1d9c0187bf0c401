"""`python -m specpipe.report SWEEP_DIR`: the command-line name of specpipe.sweep.report (kept for users' scripts)."""
from specpipe.sweep.report import main

if __name__ == "__main__":
    main()
