"""An installed wheel runs on its own: the configs and the shipped pair travel inside the package."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_wheel_installed_elsewhere_composes_and_runs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copytree(ROOT / "specpipe", src / "specpipe", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    site = tmp_path / "site"
    with zipfile.ZipFile(next((tmp_path / "dist").glob("specpipe-*.whl"))) as whl:  # what pip install unpacks
        whl.extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    where = tmp_path / "elsewhere"
    where.mkdir()
    run = lambda *a: subprocess.run([sys.executable, "-m", "specpipe", *a], cwd=where, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    p = run("--cfg", "job", "draft=ngram", "allocator=paged")
    assert p.returncode == 0 and "method: ngram" in p.stdout and "page_size" in p.stdout, p.stderr
    p = subprocess.run([sys.executable, "-c", "import specpipe.config.compose as c; print(c.CONF_DIR)"], cwd=where,
                       env=env, capture_output=True, text=True)
    assert p.stdout.strip().startswith(str(site)), p.stdout  # the wheel's own configs, not this checkout's
    p = run("workload.num_prompts=1", "workload.max_new_tokens=4", "device.num_threads=1", "draft=ngram",
            f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 0 and (tmp_path / "run" / "metrics.json").exists(), p.stderr
    # the `specpipe` console script (pip writes it from entry_points.txt) runs main() from the package, where
    # Hydra finds the configs as the module specpipe.conf, not as a folder beside a __main__ file
    entry = next(site.glob("specpipe-*.dist-info")) / "entry_points.txt"
    assert "specpipe = specpipe.__main__:main" in entry.read_text()
    script = "import sys; from specpipe.__main__ import main; sys.argv[0] = 'specpipe'; sys.exit(main())"
    p = subprocess.run([sys.executable, "-c", script, "workload.num_prompts=1", "workload.max_new_tokens=4",
                        "device.num_threads=1", "draft=none", f"hydra.run.dir={tmp_path / 'script'}"], cwd=where,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and (tmp_path / "script" / "metrics.json").exists(), p.stderr
