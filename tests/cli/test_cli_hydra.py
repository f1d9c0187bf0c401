"""Hydra's own command-line features, as a Hydra user types them: user config folders, sweep presets with
more sweeps, sweep functions, hydra.* settings, flags anywhere; each works or is one exit-2 paragraph."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from specpipe.cli.argv import expand_globs, flags_first
from specpipe.cli.precheck import precheck

SMALL = ["model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=4"]


@pytest.fixture(scope="module")
def myconf(tmp_path_factory):
    """A user's config folder: a group option of their own and a _global_ experiment preset."""
    root = tmp_path_factory.mktemp("myconf")
    (root / "draft").mkdir()
    (root / "draft" / "mytree.yaml").write_text("defaults: [base_eagle, _self_]\ntopk: 2\nnum_steps: 4\n"
                                                "num_draft_tokens: 6\n")
    (root / "myrun.yaml").write_text("defaults:\n  - config\n  - override model: random_tiny\n  - _self_\n")
    (root / "withfoo.yaml").write_text("defaults:\n  - config\n  - experiment: foo\n  - _self_\n")
    (root / "model").mkdir()
    (root / "model" / "mytiny.yaml").write_text("defaults: [random_tiny, _self_]\n")
    (root / "experiment").mkdir()
    (root / "experiment" / "badkey.yaml").write_text("# @package _global_\ndraft:\n  topkk: 3\n")
    (root / "draft" / "base_mine.yaml").write_text("defaults: [base_eagle, _self_]\ntopk: 2\n")  # named like a schema
    (root / "experiment" / "foo.yaml").write_text("# @package _global_\ndefaults:\n  - override /draft: ngram\n"
                                                  "  - override /allocator: paged\ndraft:\n  topk: 2\n")
    return root


WORKS = [["sweep=compile_policies", "compile=eager,split"],  # a preset is a sweep: -m is not needed for more
         ["hydra.mode=MULTIRUN", "draft.topk=1,2"], ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                                                     "draft.topk=1,2"],
         ["-cd", "{myconf}", "draft=mytree"], ["-cd", "{myconf}", "+experiment=foo"],
         ["hydra.searchpath=[file://{myconf}]", "+experiment=foo"], ["--cfg", "job", "draft=ngram"],
         ["-cd", "{myconf}", "-cn", "myrun", "--cfg", "job"],  # a primary config of the user's own
         ["-cd", "{myconf}", "--config-name=myrun"], ["-m", "-cd", "{myconf}", "model=mytiny,random_tiny"],
         ["-cd", "{myconf}", "-cn", "withfoo", "~experiment"],  # a group only the user's folder has
         ["-cd", "{myconf}", "-cn", "withfoo", "~experiment=foo"],
         ["~sweep", "--cfg", "job"], ["hydra.run.dir="], ["+hydra.job.env_set.OMP_NUM_THREADS=1"],
         ["--cfg", "job", "hydra.run.dir={file}/x"],  # printing a config makes no output folder
         ["hydra.run.dir={file}d/${{hydra.job.name}}/${{draft.topk}}"],  # (hydra.* keys resolve when the job runs)
         ["-m", "hydra.sweep.dir=${{oc.env:SPECPIPE_NO_SUCH_VAR,multirun}}", "draft.topk=1,2"],
         # a user's option named like a schema is an option
         ["-cd", "{myconf}", "draft=base_mine"], ["-m", "draft=ngram,suffix", "draft.num_steps=2"]]
FAILS = [(["-m", "sweep=tree_shape,compile_policies"], "one ready sweep per command"),
         (["draft.topk=1,2"], "several values (or a sweep function) make a sweep, so add -m"),
         (["-cd", "/no/such/folder"], "--config-dir '/no/such/folder' is not a folder"),
         (["-cd", "{myconf}", "draft=nope"], "config group 'draft' has no option 'nope'"),
         (["-m", "draft.topk=interval(1,4)"], "interval() asks a sweeper to sample"),
         (["-m", "draft.topk=range(1,0)"], "it gives no values, so the sweep would run no job"),
         (["-m", "draft.topk=range(1,4,0)"], "draft.topk=range(1,4,0): range() arg 3 must not be zero"),
         (["-m", "draft.topk=glob(*)"], "glob() picks options of a config group"),
         (["~seed"], "~seed: a setting cannot be removed"),
         (["-cd", "{myconf}", "~experiment"], "Could not delete 'experiment'. No match in the defaults list"),
         (["+draft=ngram"], "+draft=ngram: the config already chooses a draft option; write draft=ngram"),
         (["=1"], "the key before '=' is missing"),
         (["draft.tøpk=1"], "the key 'draft.tøpk' holds a character keys cannot have"),
         (["draft.topk =1"], "the key 'draft.topk ' holds a character keys cannot have"),
         (["hydra/launcher=ray"], "pip install -e '.[ray]'"),
         (["hydra/launcher=ray_local"], "hydra/launcher=ray_local (it extends 'ray'): the plugin for 'ray' is not "
                                        "installed"),
         (["-m", "hydra.launcher.n_jobs=2", "draft.topk=1,2"], "'hydra.launcher.n_jobs' is not a setting of the "
                                                               "launcher in use"),
         (["hydra.run.dir={file}/sub"], "which is a file; outputs need a folder"),
         (["hydra.job.env_set.OMP_NUM_THREADS=1"], "add it with a '+': +hydra.job.env_set.OMP_NUM_THREADS=1"),
         (["sweep=tree_shape", "hydra.sweeper.params.draft.topk=1"], "write draft.topk=1"),
         (["-m", "hydra.sweeper.params.draft.topk=1,2"], "write draft.topk=1,2"),
         (["-m", "allocator=glob(x*)"], "it matches none of allocator's options (hisparse, paged, swa, token)"),
         (["hydra.sweep.dir=/tmp/" + "x" * 5000, "-m", "draft.topk=1,2"], "cannot be a folder (File name too long)"),
         (["--cfg", "job", "allocator=foo"], "config group 'allocator' has no option 'foo'"),
         (["--info", "config", "draft=bogus"], "config group 'draft' has no option 'bogus'"),
         (["-m", "--cfg", "job", "draft.topk=1,2"], "--cfg and --info print one composed config"),
         (["hydra.run.dir=/tmp/${{oc.env:SPECPIPE_NO_SUCH_VAR}}"], "the environment variable SPECPIPE_NO_SUCH_VAR, "
                                                                  "which is not set"),
         (["hydra.run.dir={file}d/${{draft.nope}}"], "refers to ${draft.nope}, which is not a configuration key"),
         (["-m", "hydra.job.name=${{foo:x}}", "draft.topk=1,2"], "the resolver 'foo', which does not exist"),
         (["sweep=suffix_cache", "draft=eagle"], "invalid override draft=eagle: the ready sweep sweep=suffix_cache "
                                                 "sweeps draft.cache_tokens, which is not a setting of draft=eagle"),
         (["compile.draft_topk={{first:eager,latr:compile}}"], "'compile.draft_topk.latr' is not a configuration key "
                                                              "(valid keys there: first, fused, later)"),
         (["sampling={{temprature:1}}"], "'sampling.temprature' is not a configuration key (valid keys there: "),
         (["-cd", "{myconf}", "+experiment=badkey"], "experiment/badkey.yaml sets 'draft.topkk', which is not a "
                                                     "configuration key (valid keys there: method, num_draft_tokens"),
         (["-sc", "install=tcsh"], "completion is available for bash, zsh and fish, not 'tcsh'"),
         (["draft=base_eagle"], "base_eagle is the schema that draft options extend"),
         (["-m", "allocator=token,base_paged"], "base_paged is the schema that allocator options extend"),
         (["-cd", "{myconf}", "-cn", "myrunn"], "--config-name 'myrunn': no such config in the config folders searched "
                                                "(valid: config, myrun, withfoo)"),
         (["draft.topk=1e3"], "'1e3' (read as 1000.0) is not an integer"),
         (["-cd", "{myconf}", "+experiment=nope"], "config group 'experiment' has no option 'nope' "
                                                   "(valid: badkey, foo)"),
         (["compile.draft_topk=compile"], "compile.draft_topk holds several settings (valid keys there: first, fused, "
                                          "later), not one value"),
         (["workload=3"], "invalid override workload=3: config group 'workload' needs one of its options"),
         (["workload.prompts_file=/no/ünï p.jsonl"], "its value holds a character the override grammar reads otherwise "
                                                    "(a space, a letter outside ASCII, a parenthesis, '='); quote it"),
         (["hydra.run.dir=/tmp/x/lr=0.1"], "quote it, for the shell too: 'hydra.run.dir=\"/tmp/x/lr=0.1\"'"),
         (["-m", "workload.prompts_file=p.jsonl,ünï.jsonl"], "'workload.prompts_file=p.jsonl,\"ünï.jsonl\"' "
                                                           "(a comma still separates sweep values)"),
         (["-m", "draft=ngram,suffix", "draft.min_n=1"], "Hydra first composes a sweep's config "
                                                         "without its swept values"),
         (["hydra.job.env_set={{OMP_NUM_THREADS:1}}"], "add it with a '+': +hydra.job.env_set={OMP_NUM_THREADS:1}"),
         (["-m", 'hydra.sweeper.params={{draft.topk:"1,2"}}'], "write -m draft.topk=1,2"),
         (["hydra/launcher=jobib"], "there is no launcher 'jobib' (valid here: basic, joblib"),
         (["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobz=2", "draft.topk=1,2"],
          "'hydra.launcher.n_jobz' is not a setting of hydra/launcher=joblib (valid keys there: backend")]


@pytest.mark.parametrize("args", WORKS, ids=[" ".join(a) for a in WORKS])
def test_hydra_usage_that_works_passes_the_check(args, myconf, tmp_path):
    (tmp_path / "f").write_text("")
    assert precheck(SMALL + [a.format(myconf=myconf, file=tmp_path / "f") for a in args]) is None


def test_the_api_makes_no_output_folder_so_it_refuses_its_place_instead_of_checking_it(tmp_path):
    (tmp_path / "f").write_text("")
    said = precheck([f"hydra.run.dir={tmp_path / 'f'}/x"], api=True)
    assert "SpecPipe does not read hydra.run.dir" in said and "which is a file" not in said
    assert "which is a file" in precheck([f"hydra.run.dir={tmp_path / 'f'}/x"])


def test_globs_see_the_users_config_folders(myconf):
    assert expand_globs(["-m", "-cd", str(myconf), "model=glob(my*)"])[-1] == "model=mytiny"
    assert expand_globs([f"hydra.searchpath=[file://{myconf}]", "model=glob(*tiny,exclude=[tiny])"])[-1] == \
        "model=mytiny,random_tiny"


@pytest.mark.parametrize("args,fragment", FAILS, ids=[" ".join(a)[:60] for a, _ in FAILS])
def test_hydra_usage_that_cannot_work_is_one_paragraph(args, fragment, myconf, tmp_path):
    (tmp_path / "f").write_text("")
    msg = precheck(SMALL + [a.format(myconf=myconf, file=tmp_path / "f") for a in args])
    assert msg is not None and fragment in msg and msg.startswith("specpipe:"), msg
    assert "\n" not in msg and "Traceback" not in msg


@pytest.mark.skipif(shutil.which("srun") is not None, reason="this machine has SLURM")
def test_slurm_launcher_without_slurm_says_so():
    msg = precheck(["-m", "hydra/launcher=slurm", *SMALL, "draft.topk=1,2"])
    assert "this machine has no SLURM" in msg and "submitit_local" in msg


def test_flags_go_first_and_globs_pick_real_options_only():
    assert flags_first(["draft.topk=2", "-m", "allocator=token", "--cfg", "job", "-cd", "x", "--info"]) == \
        ["-m", "--cfg", "job", "-cd", "x", "draft.topk=2", "allocator=token", "--info"]  # a bare --info stays last
    assert flags_first(["draft.topk=2", "--info", "defaults-tree"]) == ["--info", "defaults-tree", "draft.topk=2"]
    assert expand_globs(["allocator=glob(*)"]) == ["allocator=hisparse,paged,swa,token"]  # no base_* entries
    assert expand_globs(["draft=glob(*,exclude=[none,standalone])", "x=1"]) == ["draft=eagle,ngram,suffix", "x=1"]


def test_a_sweep_with_flags_last_a_glob_and_chdir_reads_paths_from_where_it_was_typed(tmp_path):
    """hydra.job.chdir=true moves each job into its folder; a relative prompts file still means the folder the
    command was typed in. The -m after the overrides and the glob() over a group work as Hydra users expect."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def chdir_check(x):"}) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "specpipe", *SMALL, "device.num_threads=1",
                        "workload.prompts_file=p.jsonl",
                        "hydra.job.chdir=true", "-m", "allocator=glob(t*)", f"hydra.sweep.dir={tmp_path}/sweep"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    jobs = sorted(d.name for d in (tmp_path / "sweep").iterdir() if d.is_dir())
    assert jobs == ["0"], jobs  # glob(t*) is allocator=token alone
    line = json.loads((tmp_path / "sweep" / "0" / "completions.jsonl").read_text().splitlines()[0])
    assert line["prompt"] == "def chdir_check(x):" and line["finish_reason"] != "error", line


def test_shell_completion_offers_options_not_the_schemas_they_extend(tmp_path):
    env = dict(os.environ, COMP_LINE="specpipe draft=", COMP_POINT="15")
    p = subprocess.run([sys.executable, "-m", "specpipe", "-sc", "query=bash"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    offered = p.stdout.split()
    assert p.returncode == 0 and "draft=eagle" in offered and "draft=ngram" in offered, p.stderr[-2000:]
    assert not [o for o in offered if "base_" in o], offered


@pytest.mark.parametrize("name", ["ünï p.jsonl", "a(1).jsonl", "a,b.jsonl", "a=b.jsonl", "modèle.jsonl"])
def test_an_existing_path_with_characters_the_grammar_reads_is_taken_as_that_path(tmp_path, name):
    """Hydra's lexer refused a path with a space, a non-ASCII letter or a parenthesis, and a comma made a sweep:
    an existing file can only mean itself, so it is quoted for Hydra (a ~ path already was)."""
    from specpipe.config.overrides import expand_home

    path = tmp_path / name
    path.write_text(json.dumps({"prompt": "a"}) + "\n")
    args = expand_home([f"workload.prompts_file={path}"])
    assert args == [f"workload.prompts_file='{path}'"]
    assert precheck(SMALL + args) is None


def test_a_config_dir_under_home_is_expanded_for_hydra_too(monkeypatch, tmp_path):
    """A quoted '~/myconf' after -cd passed the check (which expands it) and then failed in Hydra, which does not."""
    from specpipe.config.overrides import expand_home

    monkeypatch.setenv("HOME", str(tmp_path))
    assert expand_home(["-cd", "~/myconf", "x=1"]) == ["-cd", f"{tmp_path}/myconf", "x=1"]
    assert expand_home(["--config-dir=~/myconf"]) == [f"--config-dir={tmp_path}/myconf"]
