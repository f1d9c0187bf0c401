"""python -m specpipe [group=option ...] [key=value ...] [-m for sweeps]."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from specpipe.schema import register_schemas


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    from specpipe.app import run
    from specpipe.errors import SpecpipeError

    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    try:
        result = run(cfg, out_dir=hc.runtime.output_dir)
    except SpecpipeError as e:
        print(str(e), file=sys.stderr)
        if multirun:  # one bad point must not end an overnight sweep
            return float("nan")
        sys.exit(e.exit_code)
    return float(result["metrics"]["tokens_per_s"])


def main() -> None:
    register_schemas()
    from specpipe.cli_errors import precheck

    err = precheck(sys.argv[1:])
    if err:
        print(err, file=sys.stderr)
        sys.exit(2)
    hydra_main()


if __name__ == "__main__":
    main()
