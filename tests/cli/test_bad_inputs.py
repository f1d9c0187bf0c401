"""A table of bad configs and inputs: each gives one paragraph naming the problem, exit code 2, no traceback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpipe.cli.precheck import precheck

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=random_tiny", "workload.num_prompts=2", "workload.max_new_tokens=4"]

# (overrides, message fragment, caught before Hydra runs the job)
CASES = [
    (["allocator=foo"], "has no option 'foo'", True),
    (["device=tpu"], "has no option 'tpu'", True),
    (["draft=medusa"], "has no option 'medusa'", True),
    (["compile=fastest"], "has no option 'fastest'", True),
    (["draft.bogus=1"], "'draft.bogus' is not a configuration key", True),
    (["bogus=1"], "'bogus' is not a configuration key", True),
    (["workload.max_new=5"], "'workload.max_new' is not a configuration key", True),
    (["draft.topk=abc"], "draft.topk", True),
    (["workload.batch_size=1.5"], "workload.batch_size", True),
    (["allocator.debug=maybe"], "allocator.debug", True),
    (["draft.topk=0"], "draft.topk=0 must be between 1 and 1024", True),
    (["draft.num_steps=0"], "draft.num_steps=0 must be between 1 and 128", True),
    (["draft.num_steps=100000"], "draft.num_steps=100000 must be between 1 and 128", True),
    (["draft.topk=99999999999999999999"], "draft.topk=99999999999999999999 must be between 1 and 1024", True),
    (["draft.num_draft_tokens=1"], "must be between 2", True),
    (["draft.method=ngram"], "draft.method='ngram' does not match the chosen drafter (eagle)", True),
    (["draft=ngram", "draft.method=eagle"], "draft.method='eagle' does not match the chosen drafter (ngram)", True),
    (["+draft.topkk=2"], "draft.topkk is not a setting of draft, so it would be ignored", True),
    (["+foo=3"], "foo is not a setting, so it would be ignored", True),
    (["draft.topk=2", "draft.num_steps=2", "draft.num_draft_tokens=20"], "num_draft_tokens=20 is too large", True),
    (["draft.topk=1", "draft.num_steps=3", "draft.num_draft_tokens=6"], "must be <= num_steps+1", True),
    (["allocator=paged", "allocator.page_size=3"], "page_size=3 must be a power of two", True),
    (["allocator=paged", "allocator.page_size=0"], "must be a power of two", True),
    (["allocator.num_slots=10"], "smaller than one request needs", True),
    (["allocator=swa", "allocator.window=2"], "allocator.window=2 is shorter", True),
    (["allocator=swa", "allocator.window=0", "draft=none"], "allocator.window=0 must be >= 1", True),
    (["allocator=swa", "allocator.swa_num_slots=0"], "allocator.swa_num_slots=0 must be positive", True),
    (["allocator=swa", "allocator.window=32", "allocator.swa_num_slots=10"],
     "allocator.swa_num_slots=10 is smaller than one request needs in the window pool", True),
    (["speculation.skip_after=-1"], "speculation.skip_after=-1 must be >= 0", True),
    (["speculation.min_gain=1.5"], "speculation.min_gain=1.5 must be in [0, 1)", True),
    (["speculation.cost_ms={1: {1: 0}}"], "speculation.cost_ms must map batch sizes to", True),
    (["workload.batch_size=0"], "workload.batch_size=0 must be >= 1", True),
    (["workload.max_new_tokens=0"], "workload.max_new_tokens=0 must be >= 1", True),
    (["workload.num_prompts=0"], "workload.num_prompts=0 must be >= 1", True),
    (["workload.prompt_set=poems"], "workload.prompt_set='poems' is unknown", True),
    (["workload.prompts_file=/does/not/exist.jsonl"], "is not a readable file", True),
    (["workload.prompts_file=/tmp"], "is not a readable file", True),
    (["sampling.temperature=-1"], "sampling.temperature=-1.0 must be >= 0", True),
    (["sampling.top_p=0"], "sampling.top_p=0.0 must be in (0, 1]", True),
    (["sampling.top_k=-3"], "sampling.top_k=-3 must be >= 0", True),
    (["sampling.min_p=1.5"], "sampling.min_p=1.5 must be in [0, 1] (0 is off); 0.05 to 0.1 is typical", True),
    (["sampling.temperature=inf"], "sampling.temperature=inf must be >= 0 and finite", True),
    (["sampling.seed=-3"], "sampling.seed=-3 must be between 0 and 2**63-1", True),
    (["workload.stop="], "workload.stop='' is empty", True),
    (["allocator=hisparse", "allocator.host_to_device_ratio=0"], "allocator.host_to_device_ratio=0 must be >= 1",
     True),
    (["allocator=hisparse", "model.sparse_top_k=8", "compile.verify.target_forward=compile"],
     "compile.verify.target_forward='compile' cannot run with allocator=hisparse", True),
    (["draft=ngram", "draft.min_n=3", "draft.max_n=2"], "need 1 <= min_n <= max_n", True),
    (["draft=ngram", "draft.topk=2", "draft.num_steps=3", "draft.num_draft_tokens=9"],
     "draft.num_draft_tokens=9 is too large for the n-gram trie of topk=2, num_steps=3", True),
    (["draft=ngram", "draft.topk=1024", "draft.num_steps=128", "draft.num_draft_tokens=1024"],
     "use draft.topk<=45 at num_steps=128", True),
    (["draft=suffix", "draft.max_n=300"], "need 1 <= min_n <= max_n <= 255", True),
    (["draft=suffix", "draft.cache_tokens=-5"], "draft.cache_tokens=-5 must be >= 0", True),
    (["draft=suffix", "draft.cache_tokens=lots"], "draft.cache_tokens: 'lots' is not an integer", True),
    (["draft=suffix", "draft.running_tokens=-1"], "draft.running_tokens=-1 must be >= 0", True),
    (["device.dtype=float8"], "device.dtype='float8' is unknown", True),
    (["device.num_threads=0"], "device.num_threads=0 must be >= 1", True),
    (["device.weight_layout=diagonal"], "device.weight_layout='diagonal' is not valid: use one of auto, row, column",
     True),
    (["seed=-1"], "seed=-1 must be between 0 and 2**63-1", True),
    (["seed=99999999999999999999999"], "seed=99999999999999999999999 must be between 0 and 2**63-1", True),
    (["allocator._target_=os.system"], "allocator._target_='os.system' is refused: a config builds only the class",
     True),
    (["model._target_=subprocess.call"], "refused", True),
    (["compile.draft_topk.later=jit"], "unknown mode 'jit'", True),
    (["compile.draft_topk.latr=eager"], "'compile.draft_topk.latr' is not a configuration key", True),
    (["compile.draft_topk.later=compile(dynamic=false)"], "quote a policy expression", True),
    (["draft.topk"], "invalid override 'draft.topk': overrides are key=value", True),
    (["model=null"], "config group 'model' needs one of its options (valid: hf, random_tiny, tiny)", True),
    (["~draft.topk"], "~draft.topk: a setting cannot be removed", True),
    (["workload.stop={a:1}"], "invalid value in workload.stop={a:1}: its shape (a dict)", True),
    (["compile=graph"], "graph", True),
    (["model=hf"], "model.path is required", True),
    (["latency_limit_ms=0"], "latency_limit_ms=0.0 must be > 0", True),
    (["draft.topk=0", "workload.batch_size=0", "sampling.top_k=-1"], "3 problems", True),
    (["model=hf", "model.path=/nonexistent/model"], "/nonexistent/model", False),
    (["device=cuda"], "device=cuda cannot be used", False),  # (dropped below where a GPU is visible)
    (["device=npu", "allocator=swa"], "device=npu cannot be used", False),
    (["allocator=swa"], "sliding-window layers", False),
    (["allocator=hisparse"], "has dense attention (its config sets no sparse_top_k)", False),
    (["model.sparse_top_k=0"], "model.sparse_top_k=0 must be >= 1", False),
    (["model.sparse_top_k=4", "model.sparse_local=-2"], "model.sparse_local=-2 must be >= 1", False),
    (["draft.topk=300"], "draft.topk=300 is larger than the draft's vocabulary of 258 tokens", False),
    (["model.hidden_size=7"], "model.hidden_size=7 must be a multiple of 2 * model.num_heads = 8", False),
    (["model.num_layers=0", "model.sliding_window=0"], "model.num_layers=0 must be >= 1", False),
    (["allocator.num_slots=1000000000000000"], "the KV cache does not fit in cpu memory (an allocation of", False),
    (["draft=standalone", "model=hf", "model.path=/nonexistent/model"], "/nonexistent/model", False),
    (["model=hf", "model.path="], "model.path is empty; give a model folder", True),
    (["model_timing=null"], "model_timing: it cannot be null; give model_timing=<true or false> (its default is true)",
     True),
    (["workload.ignore_eos=maybe"], "'maybe' is not true or false; give workload.ignore_eos=true or", True),
    (["allocator=paged", "allocator.page_size=48"], "must be a power of two (1, 2, 4, 8, 16, ...)", True),
    (["allocator=token", "allocator.window=64"], "'allocator.window' is not a setting of allocator=token (valid keys",
     True),
    (["allocator=paged", "allocator.page_size=1048576"], "allocator.page_size=1048576 is larger than the model's "
     "context of", False),
    (["workload.max_new_tokens=abc"], "workload.max_new_tokens: 'abc' is not an integer", True),  # given twice: the
    # last wins, as in Hydra (SMALL sets 4 first, which the message quoted)
    (["-m", "draft.topk=1,2", "draft.topk=4"], "draft.topk is given more than once (draft.topk=1,2 draft.topk=4) and "
     "the sweep draft.topk=1,2 is not the last", True),  # Hydra keeps the last: one job, silently
    (["workload.ignore_eos=2"], "workload.ignore_eos: '2' is not true or false", True),  # OmegaConf read 2 as true
    (["workload.logprobs=0"], "workload.logprobs: '0' is not true or false", True),
    (["allocator.page_size=2"], "the token allocator has page size 1 (every slot on its own); use allocator=paged",
     True),
    (["model=hf", "model.path=/tmp/" + "x" * 5000], "cannot be a path here (File name too long)", True),
    # accepted, then torch's thread pool crashed the process (SIGSEGV, no message)
    (["device.num_threads=100000"], "device.num_threads=100000 must be between 1 and 1024", True),
    (["workload.stop=0"], "workload.stop must be a non-empty string or a list of them, got 0", True),  # was dropped
    (["workload.stop=false"], "workload.stop must be a non-empty string or a list of them, got False", True),
    (["latency_limit_ms=nan"], "latency_limit_ms=nan must be > 0", True),
    (["model.seed=99999999999999999999"], "model.seed=99999999999999999999 must be between -2**63 and 2**63-1",
     True),  # was Hydra's 'Overflow when unpacking long long', exit 1
    (["draft.path=/tmp"], "draft.path='/tmp' would be ignored: model=random_tiny builds its own EAGLE head", True),
    # Hydra's "Error executing job ... a letter tokenizer has 1..26 ids", exit 1
    (["model.vocab_size=100"], "model.vocab_size=100 has no tokenizer: use 2 to 26 (letters a..z) or 256", False),
    # past int64: Hydra's "Error in call to target ... OverflowError('int too big to convert')", exit 1
    (["allocator.num_slots=99999999999999999999"], "the KV cache does not fit in cpu memory", False),
    # root may write /proc by its permissions, but no folder can be made there: Hydra's mkdir traceback, exit 1
    (["hydra.run.dir=/proc/specpipe_out"], "no folder can be made in '/proc'", True),
    # 1000000 was accepted, then the host pool (tens of GiB) got the process OOM-killed (SIGKILL)
    (["allocator=hisparse", "model.sparse_top_k=8", "allocator.host_to_device_ratio=1000000"],
     "allocator.host_to_device_ratio=1000000 must be between 1 and 1024", True),
    # the message blamed "the 658 KV slots this workload needs", not the window pool's size
    (["allocator=swa", "model.sliding_window=16", "allocator.swa_num_slots=99999999999999999999"],
     "(with allocator.swa_num_slots=99999999999999999999): the KV cache does not fit in cpu memory", False),
    # issue #46: a name under specpipe reached outside code (torch.load really ran; exit 1, Hydra's text), a class
    # of another option or a missing module gave tracebacks; each is now refused by name, before anything imports
    (["model._target_=specpipe.run.torch.load"], "model._target_='specpipe.run.torch.load' is refused", True),
    (["allocator._target_=specpipe.run.os.system"], "allocator._target_='specpipe.run.os.system' is refused", True),
    (["allocator._target_=specpipe.allocators.swa.SWAAllocator"], "is allocator=swa's class, so choose it with the "
     "config group: allocator=swa (valid: allocator={token,paged,swa,hisparse})", True),
    (["allocator._target_=specpipe.nonexistent.Foo"], "allocator._target_='specpipe.nonexistent.Foo' is refused: "
     "a config builds only the class (or function) that its allocator option's schema names", True),
    (["model._target_=specpipe.allocators.paged.PagedAllocator"], "is allocator=paged's class, not a model", True),
    (["-m", "draft.topk=1,2", "allocator._target_=specpipe.run.os.system"],
     "allocator._target_='specpipe.run.os.system' is refused", True),  # a sweep's points are checked up front too
    # issue #46: said num_threads "is not a configuration key" and then listed it as valid
    (["~device", "device.num_threads=1"], "invalid override ~device: it removes device, so 'device.num_threads' has "
     "no device to be set in; a run needs its device: choose one (device={cpu,cuda,npu})", True),
    # issue #46: "Recursive interpolation detected", naming no key
    (["seed=${seed}"], "invalid value for seed: '${seed}' leads back to seed itself, so it has no value", True),
    (["seed=${nope}"], "invalid value for seed: '${nope}' cannot be resolved (Interpolation key 'nope' not found)",
     True),
]


if torch.cuda.is_available():  # device=cuda is refused only where torch sees no GPU
    CASES = [c for c in CASES if c[0] != ["device=cuda"]]


@pytest.mark.parametrize("overrides,fragment,early", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_precheck_names_the_problem(overrides, fragment, early):
    msg = precheck(SMALL + overrides)
    if early:
        assert msg is not None and fragment in msg, msg
        assert msg.startswith("specpipe:") and "Traceback" not in msg
    else:
        assert msg is None  # only running the job can tell (missing files, devices, model structure)


def cli(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "specpipe", *args, f"hydra.run.dir={cwd}/run"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# Every case that only running the job can tell, and a sample of those the precheck catches (the same few lines of
# __main__ print them all, and test_precheck_names_the_problem checks every message): one process each, ~1-5 s.
RUN_CASES = [c for i, c in enumerate(CASES) if not c[2] or i % 8 == 0]


@pytest.mark.parametrize("overrides,fragment,early", RUN_CASES, ids=[" ".join(c[0])[:80] for c in RUN_CASES])
def test_every_case_exits_2_without_traceback(tmp_path, overrides, fragment, early):
    p = cli(SMALL + overrides, tmp_path)
    out = p.stderr + p.stdout
    assert p.returncode == 2, (overrides, p.returncode, out[-800:])
    assert fragment in p.stderr, (overrides, p.stderr)
    line = next(x for x in p.stderr.splitlines() if fragment.split("\n")[0] in x)
    assert line.startswith("specpipe:") or line.startswith("  - "), (overrides, line)  # one voice for all
    assert "Traceback" not in out, (overrides, out[-800:])
    assert not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.parametrize("target", ["model._target_=specpipe.run.torch.load",
                                    "allocator._target_=specpipe.run.os.system",
                                    "allocator._target_=specpipe.allocators.swa.SWAAllocator",
                                    "allocator._target_=specpipe.nonexistent.Foo"])
def test_a_target_outside_the_schemas_exits_2_naming_it(tmp_path, target):
    """Issue #46: torch.load really ran (exit 1, Hydra's "Error executing job"); os.system was stopped only by
    Hydra's own blocklist; a class of another option, or of no module at all, ended in a traceback."""
    p = cli(SMALL + [target], tmp_path)
    key, value = target.split("=")
    assert p.returncode == 2 and f"{key}={value!r} is refused" in p.stderr, p.stderr[-800:]
    assert "Traceback" not in p.stderr + p.stdout and "Error executing job" not in p.stderr
    assert "{token,paged,swa,hisparse}" in p.stderr or "{random_tiny,hf,tiny}" in p.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_an_output_folder_that_is_a_file_exits_2(tmp_path):
    (tmp_path / "taken").write_text("x")
    p = subprocess.run([sys.executable, "-m", "specpipe", *SMALL, f"hydra.run.dir={tmp_path}/taken"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "is a file, not a folder" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert (tmp_path / "taken").read_text() == "x"


@pytest.mark.parametrize("content,fragment,early", [
    (b"", "is empty", True), (b"\n  \n\n", "holds no prompts", False),
    (b"def f(x):\n\xff\xfe\nclass A:\n", "none of its 3 non-blank lines is a UTF-8 JSON object "
                                         "(the first reads 'def f(x):')",
     False)], ids=["empty", "blank-lines", "plain-text"])
def test_a_prompts_file_without_prompts_exits_2(tmp_path, content, fragment, early):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    args = SMALL + [f"workload.prompts_file={path}"]
    msg = precheck(args)
    assert (msg is not None and fragment in msg) if early else msg is None
    p = cli(args, tmp_path)
    assert p.returncode == 2 and fragment in p.stderr and "Traceback" not in p.stderr + p.stdout, p.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_a_run_where_every_request_fails_exits_1_and_keeps_its_outputs(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": ""}\n{"text": "no prompt field"}\n')
    p = cli(SMALL + [f"workload.prompts_file={path}"], tmp_path)
    assert p.returncode == 1 and "every request failed (2 of 2" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "request 0: line 1: empty prompt" in p.stdout and 'request 1: line 2: missing the "prompt" field' in p.stdout
    assert (tmp_path / "run" / "metrics.json").exists() and (tmp_path / "run" / "completions.jsonl").exists()


def test_prompts_from_standard_input(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "specpipe", *SMALL, "workload.prompts_file=-", f"hydra.run.dir={tmp_path}/run"]
    lines = '{"prompt": "def f(x):"}\n{"prompt_ids": [5, 6]}\n'
    p = subprocess.run(args, cwd=tmp_path, env=env, input=lines, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in recs] == ["def f(x):", "\x05\x06"] and all(len(r["output_ids"]) == 4 for r in recs)
    empty = subprocess.run(args, cwd=tmp_path, env=env, input="", capture_output=True, text=True, timeout=300)
    assert empty.returncode == 2 and "standard input held no prompts" in empty.stderr
    # a launcher's worker processes never see this process's standard input (each job said it "held no prompts")
    msg = precheck(["-m", "hydra/launcher=joblib", *SMALL, "workload.prompts_file=-", "draft=none,eagle"])
    assert "workload.prompts_file=- (standard input) reaches only this process, and hydra/launcher=joblib" in msg
    assert precheck(["-m", *SMALL, "workload.prompts_file=-", "draft=none,eagle"]) is None  # in-process: fine


def test_home_folder_paths_expand(tmp_path, monkeypatch):
    """`model.path=~/m`: the shell leaves the "~" alone after "key=", and Hydra's grammar refused it with a lexer
    exception; quoted, "~/m" was taken literally ("does not exist"). Both now mean the home folder."""
    import shutil

    from specpipe.api import SpecPipe
    from specpipe.config.compose import compose_config
    from specpipe.config.overrides import expand_home

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(ROOT / "specpipe" / "assets" / "tiny" / "target", tmp_path / "m")
    (tmp_path / "my dir").mkdir()
    assert expand_home(["model.path=~/m", "+x=~/my dir", "a=~", "b=x~/y", "--multirun", "c=~nosuchuser_xyz/z"]) == \
        [f"model.path={tmp_path}/m", f"+x='{tmp_path}/my dir'", "a=~", "b=x~/y", "--multirun", "c=~nosuchuser_xyz/z"]
    # a sweep's list: each path expanded (the first alone, once, made one job of a path with a comma in it)
    assert expand_home(["-m", "p=~/a.jsonl,~/my dir", "q=choice(~/m, /x)", "r=sort(~/m,~/n)"]) == \
        ["-m", f"p={tmp_path}/a.jsonl,'{tmp_path}/my dir'", f"q=choice({tmp_path}/m, /x)",
         f"r=sort({tmp_path}/m,{tmp_path}/n)"]
    # ... but one path stays one: a name with parentheses, an escaped comma, or an existing file with a comma
    (tmp_path / "a,b.jsonl").write_text("")
    assert expand_home(["p=~/x(1).jsonl", r"q=~/c\,d", "r=~/a,b.jsonl", "s=[a,~/b]"]) == \
        [f"p='{tmp_path}/x(1).jsonl'", f"q='{tmp_path}/c,d'", f"r='{tmp_path}/a,b.jsonl'", "s=[a,~/b]"]
    # ... also a new folder named Hydra's way, Hydra's escapes, and choice() of one
    assert expand_home(["hydra.run.dir=~/runs/lr=0.1,bs=4", r"k=~/my\ dir", "c=choice(~/m)"]) == \
        [f"hydra.run.dir='{tmp_path}/runs/lr=0.1,bs=4'", f"k='{tmp_path}/my dir'", f"c=choice({tmp_path}/m)"]
    cfg = compose_config(["model=hf", 'model.path="~/m"', 'workload.prompts_file="~/p.jsonl"'])
    assert cfg.model.path == str(tmp_path / "m") and cfg.workload.prompts_file == str(tmp_path / "p.jsonl")
    out = SpecPipe("model=hf", "model.path=~/m", "draft=none").generate(["def f():"], max_new_tokens=3)
    assert out[0].finish_reason == "length" and len(out[0].output_ids) == 3


def test_a_sweep_over_options_that_do_not_share_a_key_says_so():
    msg = precheck(["-m", *SMALL, "allocator=token,hisparse", "allocator.host_to_device_ratio=2"])
    assert "'allocator.host_to_device_ratio' is not a setting of allocator=token" in msg
    assert "sweep the allocator options that take it in a command of their own" in msg


@pytest.mark.parametrize("name", ["completions.jsonl", "metrics.json"])
def test_a_folder_where_an_output_file_goes_exits_2_before_decoding(tmp_path, name):
    """It decoded the whole workload, then exited 1 with 'Is a directory' and a wrong hint (free space)."""
    (tmp_path / "run" / name).mkdir(parents=True)
    p = subprocess.run([sys.executable, "-m", "specpipe", *SMALL, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and f"holds a folder named {name}" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "run" / "completions.partial.jsonl").exists()  # nothing decoded


def test_a_line_with_a_number_python_refuses_to_read_fails_alone(tmp_path):
    """json.loads raises a plain ValueError (not JSONDecodeError) for an integer over 4300 digits: that line fails,
    the run goes on (it ended with a traceback, exit 1, and none of the other prompts decoded)."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b'}\n{"prompt": "def f(x):"}\n')
    p = cli(SMALL + [f"workload.prompts_file={path}"], tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr + p.stdout, p.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert records[0]["finish_reason"] == "error" and records[0]["error"].startswith("line 1: not valid JSON")
    assert records[1]["finish_reason"] == "length"


@pytest.mark.parametrize("knob,model", [
    ("draft=suffix draft.running_tokens=99999999999999999999", ""),
    ("allocator=swa allocator.window=99999999999999999999", "model.sliding_window=16 allocator=swa")])
def test_a_budget_past_int64_decodes(tmp_path, knob, model):
    """draft.running_tokens=1e20 and allocator.window=1e20 passed the validator, then numpy arithmetic overflowed:
    a traceback mid-run, exit 1. A budget above what a request can hold changes nothing: the greedy tokens are
    draft=none's."""
    outputs = {}
    for name, args in (("big", [*model.split(), *knob.split()]), ("ref", [*model.split(), "draft=none"])):
        (tmp_path / name).mkdir()
        p = cli(SMALL + ["workload.batch_size=2", *args], tmp_path / name)
        assert p.returncode == 0 and "Traceback" not in p.stderr + p.stdout, p.stderr[-800:]
        lines = (tmp_path / name / "run" / "completions.jsonl").read_text().splitlines()
        outputs[name] = [json.loads(x)["output_ids"] for x in lines]
    assert outputs["big"] == outputs["ref"]


@pytest.mark.parametrize("stdin", [False, True], ids=["path", "stdin"])
def test_dev_zero_as_the_prompts_file_ends_at_the_cap_on_one_line(tmp_path, stdin):
    """issue #46: workload.prompts_file=/dev/zero (or - < /dev/zero) read until memory ran out and ended in a
    MemoryError traceback. The read stops at the cap on one line: one paragraph, exit 2, within seconds."""
    import resource
    import time

    def limited():  # (a reader that takes it all fails here at 4 GiB, not at the machine's memory)
        resource.setrlimit(resource.RLIMIT_DATA, (4 * 2 ** 30, 4 * 2 ** 30))  # (the heap; not libraries)
    args = [sys.executable, "-m", "specpipe", *SMALL, "workload.prompts_file=" + ("-" if stdin else "/dev/zero"),
            f"hydra.run.dir={tmp_path}/run"]
    start = time.monotonic()
    with open("/dev/zero", "rb") as zero:
        p = subprocess.run(args, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           stdin=zero if stdin else subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                           preexec_fn=limited)
    assert p.returncode == 2 and "Traceback" not in p.stderr + p.stdout, p.stderr[-2000:]
    said = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(said) == 1 and said[0].startswith("specpipe: workload.prompts_file=") and \
        "line 1 is longer than 16 MiB, the cap on one prompt's line" in said[0], p.stderr[-2000:]
    assert time.monotonic() - start < 120
