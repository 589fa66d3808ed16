"""Every shell command shown in README.md and docs/*.md runs. The commands are read from the docs' fenced
code blocks when the test runs, so the docs' text may change and stay true. Each runs as written, with
overrides appended that shrink it to smoke scale (SMOKE: a few iterations, a tiny width), in a temporary
copy of the repository and offline (no network, HF_HUB_OFFLINE=1). The commands of one doc file run in
order in one copy, so sample.py finds the out_dir train.py wrote before it; a command that reads a run
no earlier command of its file trained gets that run trained first, by the docs' command that writes it.
A non-zero exit or a traceback in the output fails the test.

A command that needs a GPU, the network or an hour is listed in NOT_RUN with the reason, and checked as
far as it can be: its script or module imports, its config files exist and its keys are valid.

It needs Tiny Shakespeare (data/shakespeare_char/input.txt, which `python prepare_data.py` downloads once,
or ../shared/data/tinyshakespeare/input.txt beside the clone) and, for the commands that use the GPT-2
BPE, the BPE offline (conftest.gpt2_bpe)."""

import glob
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config import ConfigError, parse_config
from conftest import tiny_hf_gpt2

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = (REPO / 'data' / 'shakespeare_char' / 'input.txt',  # prepare_data.py's download, else CI's copy
               REPO.parent / 'shared' / 'data' / 'tinyshakespeare' / 'input.txt')
DOCS = ['README.md', *sorted(os.path.relpath(p, REPO) for p in glob.glob(str(REPO / 'docs' / '*.md')))]

# The commands the test does not run, by a regular expression searched in the command: why not.
NOT_RUN = {
    r'^pip install': 'installs packages from the network',
    r'^python -m pytest': 'the test suite, this test among it',
    r'prepare_data\.py fineweb10B': 'downloads FineWeb shards (GBs)',
    r'^torchrun': 'several GPUs or machines',
    r'config/grt_small\.py': "the paper's small scale: FineWeb and a GPU",
    r'\[config/X\.py': 'a usage template, not a command',
    r'--nanogpt=': 'needs a checkout of karpathy/nanoGPT (the network)',
    r'^python -m benchmarks\.gpu_check$': 'a CUDA GPU',
    r'--device=cuda': 'a CUDA GPU',
    r'benchmarks\.gpu_check --tiny=True': 'tests/test_benchmarks.py runs it (over a minute of compiling)',
    r'benchmarks\.shared_cores': 'times the quick start at full scale, waiting for idle cores: many minutes',
    r'^python -m experiments\.study$': 'the whole study: 45 training runs, about an hour',
    r'experiments\.study --sections=tune': 'the learning-rate sweep: 65 training runs, about an hour',
}

# Appended to every command of a script (train.py's depend on the model: see smoke_args).
SMOKE = {
    'sample.py': '--num_samples=1 --max_new_tokens=8',
    'bench.py': '--scale=tiny --prompt_len=8 --new_tokens=2 --compile=False',
    'prepare_data.py': '',
    'benchmarks.train_speed': '--scale=tiny --steps=1 --compile=False',
    'benchmarks.peer': '--iters=2 --warmup=1 --repeats=1 --compile=False',
    'benchmarks.exit_sweep': '--prompt_len=28',  # of the smoke run's 32-token windows: 4 tokens decoded
    'benchmarks.memory': '',
    'benchmarks.rss_long_run': '--gb=0.001 --batches=4 --every=2 --block_size=64 --path=rss_tokens.bin',
    'experiments.analyze': '--heatmap_chars=16',
    'experiments.depth_eval': '--examples=2',
    'experiments.depth_study': ('--max_iters=2 --examples=2 --seeds=1 --steps=1,2 '
                                '--out_dir=depth-study-smoke'),
    'experiments.depth_exit': '--examples=2 --max_steps=4 --steps=1',
    'experiments.depth_probe': '--examples=2 --steps=2',
    'experiments.quickstart': '--max_iters=2',
    'experiments.study': '--iters=2',
}
TRAIN_SMOKE = ('--max_iters={iters} --eval_interval=2 --eval_iters=1 --log_interval=1 --batch_size=2 '
               '--gradient_accumulation_steps=1 --warmup_iters=1 --compile=False --peak_flops=1e12')
READS_A_RUN = ('sample.py', 'bench.py', 'experiments.analyze', 'experiments.depth_eval', 'experiments.depth_exit',
               'experiments.depth_probe', 'benchmarks.exit_sweep')
USES_GPT2_BPE = r'gpt2|prepare_data\.py shakespeare\b'  # a command whose tokens come from tiktoken
FILES = {'my.txt': 'Any UTF-8 text to train on.\n' * 200, 'prompt.txt': 'ROMEO:'}  # files the docs' commands name


# -----------------------------------------------------------------------------
# The commands in the docs


def doc_commands(doc):
    """[(line, command)] of a Markdown file: the shell commands of its fenced blocks (no language, bash
    or sh), continued lines joined, comments dropped."""
    text, commands = (REPO / doc).read_text(), []
    for block in re.finditer(r'^```(\w*)\n(.*?)^```', text, re.S | re.M):
        if block.group(1) not in ('', 'bash', 'sh', 'shell'):
            continue
        first = text[:block.start(2)].count('\n') + 1
        lines = block.group(2).replace('\\\n', ' \x00').split('\n')  # \x00: a joined line
        line_no = first
        for line in lines:
            here, line_no = line_no, line_no + 1 + line.count('\x00')
            command = re.sub(r'(^|\s)#.*$', '', line.replace('\x00', '')).strip()
            command = re.sub(r'\s+', ' ', command)
            words = command.split()
            while words and re.fullmatch(r'\w+=\S*', words[0]):  # VAR=value before the command
                words.pop(0)
            if words and words[0] in ('python', 'torchrun', 'bash', 'pip', '.'):
                commands.append((here, command))
    return commands


def parts(command):
    """The commands of a chain `a && b`."""
    return [p.strip() for p in command.split('&&')]


def script_of(part):
    """(script or module name, its arguments) of one command: 'train.py', 'experiments.analyze', ...;
    (None, []) for what is not a Python script of the repository (venv, pytest, activate, pip)."""
    words = shlex.split(part)
    while words and re.fullmatch(r'\w+=\S*', words[0]):
        words.pop(0)
    if words[:1] == ['torchrun']:
        words = words[1:]
        while words and words[0].startswith('-'):
            words.pop(0)
        words.insert(0, 'python')
    if words[:1] != ['python'] or len(words) < 2:
        return None, []
    script, args = (words[2], words[3:]) if words[1] == '-m' else (words[1], words[2:])
    path = script if script.endswith('.py') else script.replace('.', '/') + '.py'
    return (script, args) if (REPO / path).is_file() else (None, [])


def not_run(command):
    return next((why for pattern, why in NOT_RUN.items() if re.search(pattern, command)), None)


# -----------------------------------------------------------------------------
# Smoke scale


def settings(defaults, args, cwd):
    """A script's settings from its arguments, read in cwd (where the config files are)."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return parse_config(defaults, args)
    except ConfigError as e:
        raise AssertionError(f"{' '.join(args)}: {e}") from None
    finally:
        os.chdir(here)


def train_settings(args, cwd):
    import train
    return settings(train.DEFAULTS, args, cwd)


def smoke_args(script, args, cwd):
    """What is appended to a command of script to run it at smoke scale. A train.py run whose model is
    built from its config (from scratch, or resuming such a run) gets a tiny width too; a GPT-2 start is
    tiny already (conftest.tiny_hf_gpt2)."""
    from registry import PRESETS
    if script != 'train.py':
        assert script in SMOKE, f"{script} has no smoke-scale overrides: add it to tests/test_docs.py's SMOKE"
        return SMOKE[script]
    c = train_settings(args, cwd)
    start = c['init_from']
    if start == 'resume':  # the overrides of the run it continues
        writer = producers().get(c['out_dir'])
        start = train_settings(script_of(writer)[1], cwd)['init_from'] if writer else 'scratch'
    extra = TRAIN_SMOKE.format(iters=4 if c['init_from'] == 'resume' else 2)
    if start == 'scratch':
        model_type = c['model_type'] or (PRESETS[c['preset']]['model_type'] if c['preset'] in PRESETS else 'gpt')
        extra += ' --n_embd=32 --n_head=2' + (' --n_layer=2' if model_type == 'gpt' else '')
    if not c['dataset'].startswith('task:'):
        extra += ' --block_size=32'
    return extra


def out_dir_read(script, args):
    if script in READS_A_RUN:
        return next((a.split('=', 1)[1] for a in args if a.startswith('--out_dir=')), None)
    return None


def producers():
    """{out_dir: the docs' train.py command that writes it}, over every doc."""
    found = {}
    for doc in DOCS:
        for _, command in doc_commands(doc):
            if not_run(command):
                continue
            for part in parts(command):
                script, args = script_of(part)
                if script == 'train.py' and '--init_from=resume' not in args:
                    try:
                        found.setdefault(train_settings(args, REPO)['out_dir'], part)
                    except AssertionError:  # a bad command fails where its doc runs it
                        pass
    return found


def run(command, cwd, env, timeout=300):
    """Run a command as the shell would, each part of a chain with its smoke overrides; return
    (seconds, output) or raise AssertionError with the output's tail."""
    shell = []
    for part in parts(command):
        script, args = script_of(part)
        extra = smoke_args(script, args, cwd) if script else ''
        shell.append(f"{part} {extra}".strip())
    line = ' && '.join(shell)
    t0 = time.time()
    try:
        done = subprocess.run(['bash', '-c', line], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{line}\n  timed out after {timeout} s") from None
    output = done.stdout + done.stderr
    if done.returncode != 0 or 'Traceback' in output:
        tail = '\n    '.join(output.strip().splitlines()[-12:])
        raise AssertionError(f"{line}\n  exit {done.returncode}:\n    {tail}")
    return time.time() - t0, output


# -----------------------------------------------------------------------------
# What can be checked of a command that is not run


def check_not_run(command, cwd, env):
    """Each part's script or module imports and its config files and --keys are valid for it."""
    for part in parts(command):
        words = shlex.split(part)
        if words[:2] == ['pip', 'install'] and '-r' in words:
            assert (REPO / words[words.index('-r') + 1]).is_file(), f"{part}: no {words[words.index('-r') + 1]}"
        script, args = script_of(part)
        if words[:3] == ['python', '-m', 'pytest']:
            importlib.import_module('pytest')
        if script is None:
            continue
        module = importlib.import_module(script.removesuffix('.py').replace('/', '.'))
        args = [p for a in args if not re.fullmatch(r'\[.*|.*\]|\.\.\.', a)  # a template's placeholders
                for p in (sorted(glob.glob(str(cwd / a))) or [a] if '*' in a else [a])]
        if hasattr(module, 'DEFAULTS'):
            settings(module.DEFAULTS, args, cwd)
        else:  # an argparse script: every --key it is given is one its --help names
            target = [script] if script.endswith('.py') else ['-m', script]
            help_text = subprocess.run([sys.executable, *target, '--help'], cwd=cwd, env=env, capture_output=True,
                                       text=True, timeout=120).stdout
            for a in args:
                if a.startswith('--'):
                    assert a.split('=')[0] in help_text, f"{part}: {script} --help names no {a.split('=')[0]}"


# -----------------------------------------------------------------------------
# The test


def repository_copy(folder):
    """The repository's files (tracked, and new ones git does not ignore) copied into folder, with Tiny
    Shakespeare at data/shakespeare_char/input.txt and the files the docs' commands name."""
    text = next((p for p in SHAKESPEARE if p.is_file()), None)
    if text is None:
        pytest.fail("the docs' commands need Tiny Shakespeare: run `python prepare_data.py` once online (it "
                    "saves data/shakespeare_char/input.txt), or put input.txt there", pytrace=False)
    listed = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split('\n')
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    (folder / 'data' / 'shakespeare_char').mkdir(parents=True)
    shutil.copy(text, folder / 'data' / 'shakespeare_char' / 'input.txt')
    for name, text in FILES.items():
        (folder / name).write_text(text)
    return folder


def offline_env():
    env = dict(os.environ, HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1', OMP_NUM_THREADS='1',
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get('PATH', ''))
    for proxy in ('http_proxy', 'https_proxy', 'HTTP_PROXY', 'HTTPS_PROXY', 'ALL_PROXY'):
        env[proxy] = 'http://127.0.0.1:9'  # nothing listens there: any download fails at once
    for name in ('no_proxy', 'NO_PROXY'):
        env.pop(name, None)
    return env


def test_not_run_names_only_commands_in_the_docs():
    """Each entry of NOT_RUN still matches a command of the docs (else it is stale)."""
    commands = [command for doc in DOCS for _, command in doc_commands(doc)]
    assert commands, "no commands found in the docs"
    for pattern in NOT_RUN:
        assert any(re.search(pattern, c) for c in commands), f"NOT_RUN's {pattern!r} matches no command of the docs"


@pytest.mark.parametrize('doc', DOCS)
def test_every_command_of_the_docs_runs(doc, tmp_path, request):
    commands = doc_commands(doc)
    if not commands:
        return
    if any(re.search(USES_GPT2_BPE, c) for _, c in commands):
        request.getfixturevalue('gpt2_bpe')  # fails in one line where the BPE cannot load offline
    cwd, env = repository_copy(tmp_path), offline_env()
    if any('--init_from=gpt2' in c for _, c in commands):
        tiny_hf_gpt2(cwd / 'gpt2')  # 'gpt2' resolves to this folder in the cwd, offline
    made, failures, timings, writers = set(), [], [], producers()
    for line, command in commands:
        try:
            if not_run(command):
                check_not_run(command, cwd, env)
                continue
            for part in parts(command):
                script, args = script_of(part)
                needed = out_dir_read(script, args)
                if needed and needed not in made and not (cwd / needed / 'best.pt').is_file():
                    assert needed in writers, f"{part}: no command in the docs trains {needed}"
                    seconds, _ = run(writers[needed], cwd, env)
                    timings.append((seconds, f"(for line {line}) {writers[needed]}"))
                    made.add(needed)
            seconds, _ = run(command, cwd, env)
            timings.append((seconds, f"line {line}: {command}"))
            for part in parts(command):
                script, args = script_of(part)
                if script == 'train.py':
                    made.add(train_settings(args, cwd)['out_dir'])
        except AssertionError as e:
            failures.append(f"{doc}:{line}: {e}")
    for seconds, what in timings:
        print(f"{seconds:6.1f} s  {what}")
    assert not failures, f"{len(failures)} command(s) of {doc} failed:\n" + '\n'.join(failures)


# -----------------------------------------------------------------------------
# docs/training.md's config reference


def config_reference():
    """{key: default cell} of the tables under docs/training.md's '## Config reference'."""
    text = (REPO / 'docs' / 'training.md').read_text()
    section = re.search(r'^## Config reference\n(.*?)(?=^## |\Z)', text, re.S | re.M)
    assert section, "docs/training.md has no '## Config reference' section"
    rows = re.findall(r'^\| `(\w+)` \| ([^|]*) \|', section.group(1), re.M)
    keys = [key for key, _ in rows]
    assert len(keys) == len(set(keys)), f"keys listed twice: {sorted(k for k in set(keys) if keys.count(k) > 1)}"
    return dict(rows)


def test_the_config_reference_lists_every_key_with_its_default():
    """One row per train.py setting and model field, none for a key that does not exist; the default
    given first is train.py's, or the first model type's that has the field (registry.MODELS' order)."""
    import ast
    from dataclasses import fields

    import train
    from registry import MODELS
    table = config_reference()
    defaults = dict(train.TRAIN_DEFAULTS)
    for config_class, _ in MODELS.values():
        for f in fields(config_class):
            defaults.setdefault(f.name, f.default)
    assert sorted(set(defaults) - set(table)) == [], "keys missing from docs/training.md's config reference"
    assert sorted(set(table) - set(defaults)) == [], "docs/training.md's config reference names keys that do not exist"
    for key, cell in table.items():
        shown = re.match(r'\s*`([^`]*)`', cell)
        assert shown, f"{key}: its default cell {cell!r} does not start with the default in backticks"
        assert ast.literal_eval(shown.group(1)) == defaults[key], f"{key}: the table says {shown.group(1)}, the code {defaults[key]!r}"
