"""bench.py: the memory measurement against known allocations (and the torch internals it reads), the
tiny-scale run and its JSON line, the val loss of each kv_mode through the KV cache, the training
MFU, --peer at tiny settings and --gpu_check's refusal and its tiny CPU run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bench
import prepare_data
from conftest import CHARS, save_checkpoint, tiny_model
from kv_cache import KV_MODES
from registry import build_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
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


def test_recompile_count_sees_none_in_a_grt_trained_at_every_depth_and_one_for_a_new_shape():
    """A compiled GRT at r = 1..3 and in evaluation compiles several graphs and no recompile; a new batch
    size recompiles each of its 5 compiled functions (the block, the step and the step's 3 resumptions
    after its graph breaks at the two noises and the 2-block core), once for training, once for evaluation."""
    torch.compiler.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    model = build_model('grt', n_prelude=1, n_core=2, n_recur=3, n_coda=1, n_embd=32, n_head=2, block_size=16,
                        vocab_size=16)
    model.compile_regions(backend='eager')  # no codegen: fast

    def train_and_evaluate(batch_size):
        x = torch.randint(16, (batch_size, 16))
        model.train()
        for r in (1, 2, 3):
            model(x, x, num_steps=r)[1].backward()
        model.eval()
        with torch.no_grad():
            model(x, x)

    graphs = bench.compiled_graph_count()
    train_and_evaluate(2)
    assert bench.recompile_count() == 0 and bench.compiled_graph_count() - graphs > 2
    train_and_evaluate(3)
    assert bench.recompile_count() == 10


def test_recompile_count_counts_a_recompile_once_though_its_backward_logs_again():
    torch.compiler.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend='aot_eager', dynamic=False)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # compiles 0, 1 and 2: one recompile
        f(torch.randn(3, dtype=dtype, requires_grad=True)).backward()
    assert bench.recompile_count() == 1


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


def test_train_throughput_steps_the_model_and_gives_a_plausible_mfu():
    m = tiny_model('grt').float()
    before = m.transformer.core[0].mlp.c_fc.weight.detach().clone()
    tokens_per_s, mfu = bench.train_throughput(m, dict(bench.DEFAULTS, batch_size=2), 'cpu', 'float32', steps=2)
    assert tokens_per_s > 0 and 0 < mfu < 1
    assert not torch.equal(before, m.transformer.core[0].mlp.c_fc.weight)  # AdamW stepped


def test_training_mfu_is_train_pys_and_never_above_100_percent(monkeypatch, capsys):
    """train.py's formula (model.estimate_mfu against common.peak_flops_for in the run's dtype); above
    100% the CPU peak is measured again, as train.py does, and a figure still above 100% (the peak is
    wrong) is withheld with a warning."""
    m = tiny_model('grt')
    expected = 3 * m.flops_per_token(64, 2.5) * 1000 / 0.5 / 1e11
    assert bench.training_mfu(m, 1000, 0.5, 64, 2.5, 'cpu', 'float32', peak_flops=1e11) == pytest.approx(expected)
    assert bench.training_mfu(m, 1000, 0.5, 64, 2.5, 'cpu', 'float32', peak_flops=1e9) is None
    assert 'warning: MFU would be' in capsys.readouterr().err
    monkeypatch.setattr(bench, 'peak_flops_for', lambda *args: 1e9)  # a peak measured on loaded cores
    monkeypatch.setattr(bench, 'measure_cpu_peak', lambda dtype, again: 1e11 if again else 1e9)
    assert bench.training_mfu(m, 1000, 0.5, 64, 2.5, 'cpu', 'float32') == pytest.approx(expected)


def test_peer_at_tiny_settings_gives_the_table_and_json(capsys):
    result = bench.main(['--peer=True', '--peer_iters=3', '--peer_warmup=1', '--peer_repeats=2',
                         '--compile=False', '--dtype=float32'])
    out = capsys.readouterr().out
    assert 'grt/gpt step' in out and 'avx512_bf16' in out and 'bf16 matrix products measured' in out
    assert result['bf16_speedup'] > 0
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    assert result['mode'] == 'peer' and set(result['cpu_flags']) <= set(bench.CPU_FLAGS)
    assert result['iters'] == 3 and result['repeats'] == 2
    assert result['flops_per_token']['gpt'] == 4 * (24 * 128 ** 2 + 4 * 64 * 128)
    # GRT 1+1x3+1 at its mean training depth 2: 4 block passes, plus W_proj and the gate twice
    assert result['flops_per_token']['grt'] == result['flops_per_token']['gpt'] + 2 * 10 * 128 ** 2
    assert list(result['modes']) == ['float32 eager']
    m = result['modes']['float32 eager']
    assert len(m['gpt_ms_runs']) == len(m['grt_ms_runs']) == len(m['step_ratio_runs']) == 2
    assert m['gpt_ms'] > 0 and m['grt_ms'] > 0 and m['step_ratio'] > 0 and m['ratio_per_flop'] > 0
    assert m['ratio_per_flop'] == pytest.approx(m['step_ratio'] / result['flop_ratio'])
    assert m['step_ratio_spread'][0] <= m['step_ratio'] <= m['step_ratio_spread'][1]


def test_peer_times_bf16_only_where_it_is_faster(monkeypatch):
    c = dict(dtype='auto', compile=False)
    monkeypatch.setattr(bench, 'cpu_bf16_speedup', lambda: 2.5)
    assert bench.peer_modes(c, 'cpu') == [('float32', False), ('bfloat16', False)]
    monkeypatch.setattr(bench, 'cpu_bf16_speedup', lambda: 0.6)
    assert bench.peer_modes(c, 'cpu') == [('float32', False)]
    assert bench.peer_modes(dict(c, compile=True), 'cuda') == [(d, k) for d in ('float32', 'bfloat16')
                                                               for k in (False, True)]


def test_modes_are_refused_together():
    with pytest.raises(SystemExit, match='error: --peer and --train are separate modes'):
        bench.main(['--peer=True', '--train=True'])


def test_gpu_check_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    with pytest.raises(SystemExit, match='^error: needs a CUDA GPU'):
        bench.main(['--gpu_check=True'])


def test_gpu_check_runs_tiny_on_cpu(capsys):
    """The whole check with tiny overrides on CPU: both shipped configs train from the token file it
    writes (the GRT compiled, as on a GPU: its several graphs are no recompile), bench.py runs, and the
    summary's figures are there."""
    tiny = ['--device=cpu', '--dtype=float32', '--block_size=32', '--batch_size=2', '--gradient_accumulation_steps=1',
            '--n_embd=32', '--n_head=2', '--max_iters=4', '--log_interval=2', '--eval_interval=4', '--eval_iters=1']
    result = bench.run_gpu_check(
        train_args={'config/gpt2_small.py': [*tiny, '--n_layer=2', '--compile=False'],
                    'config/grt_small.py': [*tiny, '--n_recur=2', '--compile=True']},
        bench_args=['--scale=tiny', '--device=cpu', '--dtype=float32', '--compile=False', '--prompt_len=8',
                    '--new_tokens=4'], tokens=20_000)
    out = capsys.readouterr().out
    assert 'GRT/dense step time' in out
    assert set(result['train']) == {'gpt2_small', 'grt_small'}
    for run in result['train'].values():
        assert run['tokens_per_s'] > 0 and run['val_loss'] > 0 and run['peak_mem_bytes'] is None  # CPU
    assert result['train']['gpt2_small']['graphs_compiled'] == result['train']['gpt2_small']['recompiles'] == 0
    assert result['train']['grt_small']['graphs_compiled'] > 2 and result['train']['grt_small']['recompiles'] == 0
    assert result['grt_dense_step_ratio'] > 0
    assert result['grt_dense_ratio_per_flop'] is None  # MFUs against two runs' own measured CPU peaks
    assert result['bench']['scale'] == 'tiny'
