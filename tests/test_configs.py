"""The shipped configs: every one parses with train.py's settings, builds its model and trains, so a
renamed key can never break a user's command; the paper configs fit 80 GB and start training at their
real shapes; and the FLOP matching their comments claim holds."""

import glob
import json
import math
import os

import numpy as np
import pytest
import torch

from benchmarks import memory
from experiments import study
from experiments.depth_tasks import make_task
import train
from config import parse_config
from conftest import HERE
from prepare_data import GPT2_VOCAB_SIZE, write_tokens
from registry import MODELS, PRESETS, build_model

CONFIGS = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, 'config', '**', '*.py'), recursive=True)
                 if not p.endswith('__init__.py'))  # the recipes too: each parses and trains on its own
MODEL_FIELDS = set().union(*(config_class.__dataclass_fields__ for config_class, _ in MODELS.values()))
PAPER_CONFIGS = sorted(os.path.relpath(p, HERE) for pattern in ('gpt2_*', 'grt_*', 'huginn_small', 'mor_small')
                       for p in glob.glob(os.path.join(HERE, 'config', pattern + '.py')))
CHAR_VOCAB = 65  # Tiny Shakespeare's characters


def read_config(path, *overrides):
    return parse_config(train.DEFAULTS, [os.path.join(HERE, path), *overrides])


def config_model(path):
    """The model a config file describes, on the meta device (no memory, no time): its model_type and
    every model field it sets (a field its model_type lacks is refused), the dataset's vocabulary."""
    c = read_config(path)
    fields = {k: c[k] for k in MODEL_FIELDS if c.get(k) is not None}
    if c['dataset'].startswith('task:'):  # a depth task's vocabulary is its own
        fields.setdefault('vocab_size', make_task(c['dataset'][5:], c['block_size']).vocab_size)
    fields.setdefault('vocab_size', CHAR_VOCAB if c['dataset'] == 'shakespeare_char' else None)
    assert fields['vocab_size'], f"{path} sets no vocab_size for dataset {c['dataset']!r}"
    with torch.device('meta'):
        return build_model(c['model_type'] or 'gpt', **fields)


@pytest.mark.parametrize('path', CONFIGS)
def test_config_builds_its_model_on_meta(path):
    model = config_model(path)
    assert model.get_num_params() > 0


# ---------------------------------------------------------------------------------------------
# Two training steps of every other config through train.main, widths shrunk, layouts kept


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    """data/tiny/: random characters over Tiny Shakespeare's 65-character vocabulary."""
    root = tmp_path_factory.mktemp('data')
    tokens = np.random.default_rng(0).integers(CHAR_VOCAB, size=5000)
    os.makedirs(root / 'tiny')
    write_tokens(str(root / 'tiny' / 'train.bin'), tokens[:4000])
    write_tokens(str(root / 'tiny' / 'val.bin'), tokens[4000:])
    with open(root / 'tiny' / 'meta.json', 'w') as f:
        json.dump({'tokenizer': 'char', 'vocab_size': CHAR_VOCAB, 'chars': ''.join(map(chr, range(33, 98)))}, f)
    return str(root)


TINY = dict(n_embd=32, n_head=2, block_size=16, batch_size=2, gradient_accumulation_steps=1, max_iters=2,
            eval_iters=1, eval_interval=2, log_interval=1, compile=False, dtype='float32', device='cpu',
            peak_flops=1e12)  # a fixed peak: no measuring


@pytest.mark.parametrize('path', [p for p in CONFIGS if p not in PAPER_CONFIGS])
def test_config_trains_two_steps(path, data_root, tmp_path):
    out_dir = tmp_path / 'out'
    argv = [os.path.join(HERE, path), f'--data_dir={data_root}', '--dataset=tiny', f'--out_dir={out_dir}',
            *[f'--{k}={v}' for k, v in TINY.items()]]
    result = train.main(argv)
    assert result['iter_num'] == 2 and math.isfinite(result['val_loss'])
    assert os.path.isfile(out_dir / 'ckpt.pt')


# ---------------------------------------------------------------------------------------------
# The paper configs on their real path: memory per GPU, and training at their real shapes


@pytest.mark.parametrize('model', ['gpt', 'grt', 'huginn'])
def test_memory_estimate_against_an_independent_count(model):
    B, T, d, a, V = 4, 16, 32, 2, 50
    block = 12 * d * d + 13 * d  # attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, two LayerNorms 4 d
    if model == 'gpt':
        net, passes = build_model('gpt', n_layer=2, n_embd=d, n_head=a, block_size=T, vocab_size=V), 2
        params = V * d + T * d + 2 * block + 2 * d  # wte (tied head), wpe, 2 blocks, ln_f
    else:
        layout = dict(n_prelude=1, n_core=2, n_recur=3, n_coda=1, n_embd=d, n_head=a, block_size=T, vocab_size=V)
        if model == 'grt':
            net, passes = build_model('grt', **layout), 1 + 2 * 3 + 1  # every step keeps its activations
            step = (2 * d * d + d) + 2 * (2 * d) + (2 * d * d + d) + (d * d + d)  # W_proj, ln_h + ln_e, f_g
        else:
            net, passes = build_model('huginn', **layout, backprop_depth=2), 1 + 2 * 2 + 1  # the last k = 2 steps
            step = 2 * d * d + d  # the adapter
        params = V * d + T * d + 4 * block + 2 * d + step
    assert net.get_num_params(non_embedding=False) == params
    est = memory.memory_estimate(net, B, T, 'float32')
    assert est['weights'] == 4 * params and est['grads'] == 4 * params and est['optimizer'] == 8 * params
    assert est['block_passes'] == passes
    assert est['activations'] == passes * 66 * B * T * d + B * T * V * 8
    est = memory.memory_estimate(net, B, T, 'bfloat16')
    assert est['activations'] == passes * 34 * B * T * d + B * T * V * 6
    assert est['total'] == 16 * params + est['activations']


def test_paper_configs_fit_80_gb_at_their_micro_batch(capsys):
    """benchmarks/memory.py on every paper config, each built on the meta device at its real block_size,
    width and layout: the analytic memory per GPU at the configured micro-batch fits in 80 GB."""
    estimates = memory.main(PAPER_CONFIGS)
    assert list(estimates) == PAPER_CONFIGS and len(PAPER_CONFIGS) == 11
    out = capsys.readouterr().out.splitlines()
    for path, line in zip(PAPER_CONFIGS, out):
        c = read_config(path)
        model = config_model(path)
        assert model.config.block_size == c['block_size'] == 1024 and model.config.n_embd == c['n_embd']
        assert estimates[path] == memory.memory_estimate(model, c['batch_size'], 1024, 'bfloat16')
        assert 0 < estimates[path]['total'] <= 80e9 and line.startswith(f"{path}: micro-batch {c['batch_size']} x 1024")
        assert line.endswith('fits')


@pytest.fixture(scope='module')
def fineweb_root(tmp_path_factory):
    """data/fineweb10B/ as `prepare_data.py fineweb10B` leaves it: a train and a val shard of random GPT-2
    ids (uint16, the shards' header) under the shards' names, and meta.json."""
    root = tmp_path_factory.mktemp('data')
    os.makedirs(root / 'fineweb10B')
    rng = np.random.default_rng(0)
    write_tokens(str(root / 'fineweb10B' / 'fineweb_train_000001.bin'), rng.integers(GPT2_VOCAB_SIZE, size=20_000))
    write_tokens(str(root / 'fineweb10B' / 'fineweb_val_000000.bin'), rng.integers(GPT2_VOCAB_SIZE, size=5_000))
    with open(root / 'fineweb10B' / 'meta.json', 'w') as f:
        json.dump({'tokenizer': 'gpt2', 'vocab_size': GPT2_VOCAB_SIZE}, f)
    return str(root)


# The small paper configs in every run (about 90 s, 3 GB); all eleven (up to 14 GB: too much for CI)
# with GRT_ALL_PAPER_CONFIGS=1.
REAL_SHAPE_CONFIGS = PAPER_CONFIGS if os.environ.get('GRT_ALL_PAPER_CONFIGS') else [
    p for p in PAPER_CONFIGS if p.endswith(('_small.py',))]


@pytest.mark.parametrize('path', REAL_SHAPE_CONFIGS)
def test_paper_config_trains_at_its_real_shapes(path, fineweb_root, tmp_path, monkeypatch):
    """One iteration at batch 1 with the config's own block_size (1024), width and layout, on its own
    dataset name (fineweb10B, here a local shard), in fp32 on the CPU without compile: the fresh model's
    loss on random GPT-2 ids is about log(vocab_size), and the checkpoints hold the config's model (not
    written to disk: up to 12 GB for the large configs' optimizer states)."""
    saved = {}
    monkeypatch.setattr(train, 'save_checkpoint', lambda p, checkpoint: saved.update({os.path.basename(p): checkpoint}))
    argv = [os.path.join(HERE, path), f'--data_dir={fineweb_root}', f'--out_dir={tmp_path}', '--batch_size=1',
            '--gradient_accumulation_steps=1', '--max_iters=1', '--eval_iters=1', '--device=cpu',
            '--dtype=float32', '--compile=False', '--peak_flops=1e12']
    result = train.main(argv)
    with open(tmp_path / 'log.jsonl') as f:
        (row,) = [json.loads(line) for line in f]
    c = read_config(path)
    assert result['iter_num'] == 1 and row['tokens'] == 1024 and set(saved) == {'best.pt', 'ckpt.pt'}
    assert abs(row['loss'] - math.log(c['vocab_size'])) < 0.5 and abs(row['val_loss'] - math.log(c['vocab_size'])) < 0.5
    fields = {k: c[k] for k in MODEL_FIELDS if c.get(k) is not None}
    assert {k: saved['ckpt.pt']['model_args'][k] for k in fields} == fields and fields['block_size'] == 1024


# ---------------------------------------------------------------------------------------------
# What the configs' comments claim


PAPER = {'gpt2_small': 'gpt2-small', 'gpt2_medium': 'gpt2-medium', 'gpt2_large': 'gpt2-large',
         'grt_small': 'grt-small-isoflop', 'grt_medium': 'grt-medium-isoflop', 'grt_large': 'grt-large-isoflop',
         'grt_small_isoparam': 'grt-small-isoparam', 'grt_medium_isoparam': 'grt-medium-isoparam',
         'grt_large_isoparam': 'grt-large-isoparam'}


@pytest.mark.parametrize('name', PAPER)
def test_paper_configs_spell_out_the_presets(name):
    c = read_config(f'config/{name}.py')
    assert {k: c[k] for k in PRESETS[PAPER[name]]} == PRESETS[PAPER[name]]


def test_paper_configs_keep_half_a_million_tokens_a_step():
    for path in CONFIGS:
        c = read_config(path)
        if c['dataset'] == 'fineweb10B':
            assert c['batch_size'] * c['gradient_accumulation_steps'] * c['block_size'] == 524_288, path
            assert c['min_lr'] == pytest.approx(c['learning_rate'] / 10), path


@pytest.mark.parametrize('dense, recurrent', [('gpt2_small', 'grt_small'), ('gpt2_medium', 'grt_medium'),
                                              ('gpt2_large', 'grt_large')])
def test_isoflop_twins_pass_through_as_many_blocks(dense, recurrent):
    """The paper's isoFLOP layouts: p + c x R + k block passes at eval depth R = the dense layer count
    (the gate and W_proj add 10 R d^2 on top), same width."""
    gpt, grt = config_model(f'config/{dense}.py'), config_model(f'config/{recurrent}.py')
    assert grt.num_block_passes(grt.config.n_recur) == gpt.config.n_layer
    assert grt.config.n_embd == gpt.config.n_embd


SHAKESPEARE = ['huginn', 'mor', 'rung1', 'rung2', 'rung3', 'rung4']


def shakespeare_config(name):
    """The Tiny Shakespeare config of a model: the quick-start pair at the top of config/, the study's others in config/study/."""
    return f'config/shakespeare_char_{name}.py' if name in ('gpt', 'grt') else f'config/study/{name}.py'


@pytest.mark.parametrize('path, reference, tolerance', [
    ('config/huginn_small.py', 'config/grt_small.py', 0.01),
    ('config/mor_small.py', 'config/grt_small.py', 0.03),
    ('config/shakespeare_char_grt.py', 'config/shakespeare_char_gpt.py', 0.02),  # the quick-start twins
    *[(shakespeare_config(name), shakespeare_config(ref), 0.03)
      for name in SHAKESPEARE for ref in ('gpt', 'grt')],
])
def test_isoflop_configs_match_in_training_flops(path, reference, tolerance):
    model, grt = config_model(path), config_model(reference)
    seq_len = grt.config.block_size
    assert model.config.block_size == seq_len and model.config.n_embd == grt.config.n_embd
    assert study.mean_train_flops(model, seq_len) == pytest.approx(study.mean_train_flops(grt, seq_len), rel=tolerance)


# ---------------------------------------------------------------------------------------------
# study.py's models (config/study/recipe.py is its recipe)


@pytest.mark.parametrize('name', [m for m in study.MODELS if m != 'grt_deep'])
def test_study_models_match_dense_training_flops(name):
    """isoFLOP and ladder runs cost the dense model's training FLOPs per token (within 3.5%)."""
    dense = study.mean_train_flops(study.model_of('gpt'))
    assert abs(study.mean_train_flops(study.model_of(name)) / dense - 1) < 0.035


def test_isoparam_model_matches_dense_unique_blocks():
    dense, deep = study.model_of('gpt'), study.model_of('grt_deep')
    assert deep.config.n_layer == dense.config.n_layer  # 1 + 4 + 1 unique blocks against 6 layers
    assert deep.num_block_passes(deep.config.n_recur) > dense.config.n_layer  # deeper at the same blocks


@pytest.mark.parametrize('name', [m for m in study.MODELS if m != 'grt_deep'])
def test_study_models_are_the_shakespeare_char_configs(name):
    """study.py's models have the layouts of their Tiny Shakespeare configs, at the recipe's width;
    but for grt's depth: the study's is the paper's 1 + 1x5 + 1 at r ~ U{1..5} (gate bias +4), the quick
    start's 1 + 1x3 + 1 at a fixed r = 3 (bias 0), the same FLOPs."""
    c, recipe = read_config(shakespeare_config(name)), read_config(study.RECIPE)
    if name == 'grt':
        assert (c['n_recur'], c['train_depth'], c['gate_bias']) == (3, 'fixed', 0.0)
        c = dict(c, n_recur=5)
        assert 'train_depth' not in study.MODELS[name] and 'gate_bias' not in study.MODELS[name]
    assert {k: c[k] for k in study.MODELS[name]} == study.MODELS[name]
    assert (recipe['n_embd'], recipe['n_head'], recipe['block_size']) == (c['n_embd'], c['n_head'], study.SEQ_LEN)
