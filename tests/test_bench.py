"""bench.py: the memory measurement against known allocations (and the torch internals it reads), the
tiny-scale run and its JSON line, compiled decoding, early exit in the decode timings, the val loss of
each kv_mode through the KV cache, and a trained model's checkpoint that cannot be read."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bench
import prepare_data
from conftest import CHARS, HERE, save_checkpoint, tiny_model
from early_exit import ExitingModel
from kv_cache import KV_MODES

JSON_KEYS = {'scale', 'device', 'dtype', 'batch_size', 'prompt_len', 'new_tokens', 'models'}


def test_cpu_peak_bytes_of_a_known_allocation_pattern():
    def allocate():
        a = torch.empty(1000, 1000)  # 4,000,000 bytes
        b = torch.empty(250, 1000)  # + 1,000,000
        del a  # - 4,000,000
        c = torch.empty(2000, 1000)  # + 8,000,000: the peak is b + c, not a + b + c nor c alone
        return b, c

    (b, c), peak = bench.cpu_peak_bytes(allocate)
    assert peak == 9_000_000
    _, peak = bench.cpu_peak_bytes(lambda: torch.ones(3, 1000, dtype=torch.float64).sum())
    assert 24_000 <= peak <= 24_000 + 64  # the tensor, plus the 0-d sum


def test_cpu_peak_bytes_fails_loudly_if_the_profiler_internals_change(monkeypatch):
    """A torch whose profiler lacks kineto_results (or records no memory events) stops the figure with
    one line naming the function to update, instead of a wrong peak."""
    class NoKineto:
        def __init__(self, **kwargs):
            self.profiler = object()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bench, 'profile', NoKineto)
    with pytest.raises(bench.TorchInternalsChanged, match='kineto_results.*bench.cpu_peak_bytes'):
        bench.cpu_peak_bytes(lambda: torch.empty(1000))


def test_compiled_graph_count_counts_a_compile_and_a_recompile():
    torch.compiler.reset()
    before = bench.compiled_graph_count()
    f = torch.compile(lambda x: x.sin() + 1, backend='eager', dynamic=False)  # no codegen: fast
    f(torch.randn(3))
    f(torch.randn(3))
    assert bench.compiled_graph_count() - before == 1
    f(torch.randn(5))  # a new static shape: one recompile
    assert bench.compiled_graph_count() - before == 2


def test_tensor_bytes_counts_tied_weights_once():
    m = tiny_model('gpt')
    unique = sum(p.numel() for p in m.parameters()) * 4  # parameters() yields the tied head once
    assert bench.tensor_bytes(list(m.state_dict().values())) == unique  # the state dict lists it twice


def test_peak_decode_memory_holds_weights_and_cache():
    """Measured peak >= weights + the whole KV cache (allocated at the first forward), and the rest
    (activations, logits) is small for a tiny model."""
    m = tiny_model('grt').float()
    c = dict(bench.DEFAULTS, prompt_len=20, new_tokens=10, kv_mode='per_step')
    idx = torch.randint(len(CHARS), (2, 20))
    peak = bench.peak_decode_memory(m, idx, c, 'cpu')
    kv = bench.kv_bytes_per_token(m, 'per_step', 4)
    assert kv == m.num_block_passes(m.config.n_recur) * 2 * 64 * 4
    floor = bench.tensor_bytes(list(m.parameters())) + kv * 30 * 2
    assert floor <= peak <= floor + 400_000
    # one shared cache per core layer: the peak falls by the R - 1 steps' caches it does not keep
    c['kv_mode'] = 'shared'
    saved = (m.config.n_recur - 1) * m.config.n_core * 2 * 64 * 4 * 30 * 2
    assert bench.kv_bytes_per_token(m, 'shared', 4) == kv - saved // 60
    assert abs((peak - bench.peak_decode_memory(m, idx, c, 'cpu')) - saved) < 20_000


def run_bench(*args):
    r = subprocess.run([sys.executable, 'bench.py', '--scale=tiny', '--device=cpu', '--prompt_len=8',
                        '--new_tokens=4', *args], cwd=HERE, capture_output=True, text=True,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, json.loads(r.stdout.strip().splitlines()[-1])


def test_tiny_scale_json_line_has_every_field():
    out, result = run_bench('--dtype=float32', '--compile=False', '--kv_mode=shared')
    assert 'peak decode memory' in out and 'decode ms/token (eager)' in out  # the readable table
    assert set(result) == JSON_KEYS
    assert (result['scale'], result['device'], result['dtype']) == ('tiny', 'cpu', 'float32')
    assert (result['batch_size'], result['prompt_len'], result['new_tokens']) == (1, 8, 4)
    assert set(result['models']) == {'gpt', 'grt_isoflop', 'grt_isoparam'}
    for key, m in result['models'].items():
        assert set(m) == set(bench.FIELDS), key
        assert m['decode_ms_per_token_compiled'] is None
        assert m['prefill_ms'] > 0 and m['decode_ms_per_token'] > 0
        assert m['analytic_mem_bytes'] == m['params'] * 4 + m['kv_bytes_per_token'] * 12
        assert m['analytic_mem_bytes'] <= m['peak_mem_bytes'] < m['analytic_mem_bytes'] + 1_000_000
    gpt, flop, param = (result['models'][k] for k in ('gpt', 'grt_isoflop', 'grt_isoparam'))
    for key, spec in bench.SCALES['tiny'].items():  # params as the models count them, embeddings included
        assert result['models'][key]['params'] == bench.build_preset(*spec).get_num_params(non_embedding=False)
    assert (gpt['kv_mode'], flop['kv_mode']) == ('per_step', 'shared')
    # KV per token: 4 dense layers; shared keeps one cache per unique block (1+1+1 and 1+2+1)
    assert (gpt['kv_bytes_per_token'], flop['kv_bytes_per_token'], param['kv_bytes_per_token']) == (
        4 * 2 * 64 * 4, 3 * 2 * 64 * 4, 4 * 2 * 64 * 4)


def test_compiled_decode_is_timed_and_matches_eager():
    m = tiny_model('grt', n_recur=2)
    idx = torch.randint(len(CHARS), (1, 6))
    eager = m.generate(idx, 5, temperature=0)
    c = dict(bench.DEFAULTS, prompt_len=6, new_tokens=5, compile=True)
    figures = bench.bench_model(m, c, 'cpu', 'float32')
    assert figures['decode_ms_per_token_compiled'] > 0
    assert figures['graphs_compiled'] >= 1
    assert torch.equal(m.generate(idx, 5, temperature=0), eager)  # m is compiled now


def test_prompt_that_does_not_fit_is_refused():
    r = subprocess.run([sys.executable, 'bench.py', '--scale=tiny', '--prompt_len=60', '--new_tokens=8',
                        '--compile=False'], cwd=HERE, capture_output=True, text=True)
    assert r.returncode != 0
    assert 'prompt_len + new_tokens = 68 exceeds block_size 64' in r.stderr


def test_cached_val_loss_per_step_equals_uncached_and_approximations_differ():
    m = tiny_model('grt')
    tokens = torch.randint(len(CHARS), (3, 41))
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits, _ = m(x, targets=y)
    uncached = torch.nn.functional.cross_entropy(logits[:, 9:].reshape(-1, len(CHARS)), y[:, 9:].reshape(-1))
    losses = {mode: bench.cached_val_loss(m, tokens, 10, mode) for mode in KV_MODES}
    assert losses['per_step'] == pytest.approx(uncached.item(), abs=1e-5)
    assert abs(losses['shared'] - losses['per_step']) > 1e-4
    assert abs(losses['mean'] - losses['per_step']) > 1e-4


def test_out_dir_reports_val_loss_per_kv_mode(tmp_path, capsys):
    """best.pt by default, and the val windows come from its train.py config's data_dir and dataset;
    --ckpt=ckpt.pt reads the latest state and its config."""
    data_dir = tmp_path / 'data'
    os.makedirs(data_dir / 'chars')
    rng = np.random.default_rng(0)
    prepare_data.write_tokens(str(data_dir / 'chars' / 'val.bin'), rng.integers(0, len(CHARS), 5000))
    out_dir = save_checkpoint(str(tmp_path / 'out'), tiny_model('grt'), 'grt',
                              config=dict(data_dir=str(data_dir), dataset='chars'))
    latest = torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=False)
    latest['config'] = dict(data_dir=str(data_dir), dataset='elsewhere')
    torch.save(latest, os.path.join(out_dir, 'ckpt.pt'))
    args = [f'--out_dir={out_dir}', '--device=cpu', '--dtype=float32', '--compile=False', '--prompt_len=8',
            '--new_tokens=4']
    bench.main(args)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result['scale'] == out_dir
    trained = result['models']['trained']
    assert set(trained['val_loss']) == set(KV_MODES)
    # a random model over 62 characters: every loss near ln(62)
    assert all(3.5 < v < 4.7 for v in trained['val_loss'].values())
    with pytest.raises(SystemExit, match=r'error: validation data .*elsewhere'):
        bench.main(args + ['--ckpt=ckpt.pt'])




def test_early_exit_in_the_decode_timings(capsys):
    """--exit_threshold decodes the GRTs through early_exit.ExitingModel (0 never exits, so the tokens are
    the fixed depth's), leaves the dense GPT whole, and a rule that does not apply stops with one line."""
    grt, gpt = tiny_model('grt'), tiny_model('gpt')
    idx = torch.randint(len(CHARS), (2, 6))
    c = dict(bench.DEFAULTS, exit_threshold=0.0)
    assert isinstance(bench.decoder(grt, c), ExitingModel)
    assert torch.equal(bench.decoder(grt, c).generate(idx, 5, temperature=0), grt.generate(idx, 5, temperature=0))
    assert bench.decoder(gpt, c) is gpt and bench.decoder(grt, dict(bench.DEFAULTS)) is grt
    with pytest.raises(SystemExit, match='^error: '):
        bench.decoder(grt, dict(c, exit='kl', kv_mode='mean'))
    result = bench.main(['--scale=tiny', '--device=cpu', '--dtype=float32', '--compile=False', '--prompt_len=8',
                         '--new_tokens=4', '--exit_threshold=0.5'])
    assert 'early exit state < 0.5' in capsys.readouterr().out
    assert result['models']['grt_isoflop']['decode_ms_per_token'] > 0


def test_a_checkpoint_that_cannot_be_read_is_one_line(tmp_path):
    """A truncated best.pt stops bench.py with one `error:` line (common.load_checkpoint), no traceback."""
    out_dir = save_checkpoint(str(tmp_path / 'out'), tiny_model('grt'), 'grt')
    path = os.path.join(out_dir, 'best.pt')
    with open(path, 'rb') as f:
        data = f.read()
    with open(path, 'wb') as f:
        f.write(data[:len(data) // 2])
    r = subprocess.run([sys.executable, 'bench.py', f'--out_dir={out_dir}', '--device=cpu', '--dtype=float32',
                        '--compile=False'], cwd=HERE, capture_output=True, text=True)
    assert r.returncode != 0 and 'Traceback' not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith('error: ') and 'best.pt' in r.stderr
