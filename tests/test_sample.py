"""sample.py on tiny checkpoints made here, and the GRT KV-cache modes (model.py, kv_cache.py) it exposes."""

import os
import subprocess
import shutil
import sys

import pytest
import torch

import sample
from conftest import CHARS, HERE, save_checkpoint, scramble, tiny_model
from kv_cache import KV_MODES
from registry import from_checkpoint



def run_sample(capsys, *args):
    sample.main(['--device=cpu', '--dtype=float32', '--num_samples=1', '--max_new_tokens=30', *args])
    return capsys.readouterr()


def test_same_seed_same_text_and_different_seed_differs(grt_dir, capsys):
    a = run_sample(capsys, f'--out_dir={grt_dir}', '--start=ROMEO:', '--seed=1').out
    b = run_sample(capsys, f'--out_dir={grt_dir}', '--start=ROMEO:', '--seed=1').out
    c = run_sample(capsys, f'--out_dir={grt_dir}', '--start=ROMEO:', '--seed=2').out
    assert a == b
    assert a != c
    assert a.startswith('ROMEO:')
    body = a.split('\n---------------')[0]
    assert len(body) == len('ROMEO:') + 30  # one char per token


def sampled_text(m, start, seed, max_new_tokens=30, **kwargs):
    """What sample.py should print for one sample: model.generate from the same seed and settings."""
    stoi = {ch: i for i, ch in enumerate(CHARS)}
    torch.manual_seed(seed)
    idx = m.generate(torch.tensor([[stoi[ch] for ch in start]]), max_new_tokens, **kwargs)
    return ''.join(CHARS[i] for i in idx[0].tolist())


def test_streamed_text_is_the_generated_tokens(grt_dir, capsys):
    """What sample.py prints equals model.generate on the same checkpoint, seed and settings."""
    out = run_sample(capsys, f'--out_dir={grt_dir}', '--start=KING', '--seed=3', '--temperature=1.0',
                     '--top_k=5', '--num_steps=3', '--kv_mode=mean').out
    m = from_checkpoint(torch.load(os.path.join(grt_dir, 'best.pt'), weights_only=False)).eval()
    expected = sampled_text(m, 'KING', 3, temperature=1.0, top_k=5, num_steps=3, kv_mode='mean')
    assert out.split('\n---------------')[0] == expected


def test_best_pt_by_default_and_the_latest_with_ckpt(tmp_path, capsys):
    """best.pt (best val loss) is the default; --ckpt=ckpt.pt picks the latest state."""
    best, latest = scramble(tiny_model('grt'), seed=1), scramble(tiny_model('grt'), seed=2)
    out_dir = save_checkpoint(str(tmp_path / 'run'), best, 'grt', latest=latest)
    args = (f'--out_dir={out_dir}', '--start=KING', '--temperature=0')
    printed = lambda *extra: run_sample(capsys, *args, *extra).out.split('\n---------------')[0]
    assert printed() == printed('--ckpt=best.pt') == sampled_text(best, 'KING', 0, temperature=0)
    assert printed('--ckpt=ckpt.pt') == sampled_text(latest, 'KING', 0, temperature=0)
    assert sampled_text(best, 'KING', 0, temperature=0) != sampled_text(latest, 'KING', 0, temperature=0)
    assert f"sampling from {os.path.join(out_dir, 'best.pt')} (iteration 100, val loss 2.5000)" in \
        run_sample(capsys, *args).err
    assert f"sampling from {os.path.join(out_dir, 'ckpt.pt')} (iteration 200)" in \
        run_sample(capsys, *args, '--ckpt=ckpt.pt').err


def test_cli_runs_and_loads_compiled_checkpoint(tmp_path):
    """The real command line, on a checkpoint whose keys carry torch.compile's _orig_mod. prefix."""
    out_dir = save_checkpoint(str(tmp_path / 'gpt'), tiny_model('gpt'), 'gpt', prefix='_orig_mod.')
    r = subprocess.run([sys.executable, 'sample.py', f'--out_dir={out_dir}', '--device=cpu', '--num_samples=2',
                        '--max_new_tokens=10', '--start=Hi'], cwd=HERE, capture_output=True, text=True,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('---------------') == 2
    assert r.stdout.startswith('Hi')


@pytest.mark.parametrize('model_type', ['gpt', 'grt'])
def test_greedy_tokens_with_cache_equal_without(model_type):
    m = scramble(tiny_model(model_type))
    idx = torch.randint(len(CHARS), (2, 7))
    cached = m.generate(idx, 40, temperature=0)
    uncached = m.generate(idx, 40, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 7:].tolist())) > 2  # a real test: not one repeated token
    # past block_size (64) the window slides and the cache is rebuilt: still equal
    long_cached = m.generate(idx, 70, temperature=0)
    assert torch.equal(long_cached, m.generate(idx, 70, temperature=0, use_cache=False))


def test_generate_tokens_streams_what_generate_returns():
    m = tiny_model('grt')
    idx = torch.randint(len(CHARS), (1, 5))
    torch.manual_seed(7)
    whole = m.generate(idx, 12, temperature=1.0)
    torch.manual_seed(7)
    pieces = list(m.generate_tokens(idx, 12, temperature=1.0))
    assert len(pieces) == 12 and all(p.shape == (1, 1) for p in pieces)
    assert torch.equal(whole, torch.cat([idx, *pieces], dim=1))


def teacher_forced_logits(m, x, prompt_len, kv_mode, num_steps=None):
    """Prefill x[:, :prompt_len], then feed the rest one token at a time through the cache."""
    cache = m.new_kv_cache(x.size(1), num_steps, kv_mode=kv_mode)
    logits = [m(x[:, :prompt_len], targets=x[:, :prompt_len], num_steps=num_steps, kv_cache=cache)[0]]
    for i in range(prompt_len, x.size(1)):
        logits.append(m(x[:, i:i + 1], targets=x[:, i:i + 1], num_steps=num_steps, kv_cache=cache)[0])
    return torch.cat(logits, dim=1)


def test_kv_modes_per_step_exact_shared_and_mean_approximate():
    m = tiny_model('grt')
    x = torch.randint(len(CHARS), (2, 40))
    exact, _ = m(x, targets=x)
    got = {mode: teacher_forced_logits(m, x, 10, mode) for mode in KV_MODES}
    for mode in KV_MODES:  # a prefilled chunk is exact within itself in every mode
        torch.testing.assert_close(got[mode][:, :10], exact[:, :10], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got['per_step'], exact, atol=1e-5, rtol=1e-5)
    # the approximations change the function after the prompt, and differently from each other
    for a, b in [('shared', 'per_step'), ('mean', 'per_step'), ('shared', 'mean')]:
        assert (got[a][:, 10:] - got[b][:, 10:]).abs().max() > 1e-3, (a, b)
    for mode in KV_MODES:  # and each one generates, at another depth too
        out = m.generate(x[:, :5], 20, temperature=1.0, top_k=10, num_steps=2, kv_mode=mode)
        assert out.shape == (2, 25)


def test_shared_and_mean_against_a_written_out_reference():
    """One core layer, R = 2, decoding token 2 after a prefilled 2-token prompt: check the keys the
    new token's attention sees against the definition (final-step or mean keys of tokens 0-1)."""
    m = tiny_model('grt', n_recur=2)
    x = torch.randint(len(CHARS), (1, 3))
    seen = []  # (step, k) every core-layer update receives, recorded through the uncached forward
    attn = m.transformer.core[0].attn
    hook = attn.c_attn.register_forward_hook(lambda mod, inp, out: seen.append(out.split(64, dim=2)[1]))
    m(x)  # uncached: keys of all 3 tokens at steps 1 and 2
    hook.remove()
    k1, k2 = seen  # (1, 3, 64) each: step 1 and step 2
    for mode, stored in [('shared', k2[:, :2]), ('mean', (k1[:, :2] + k2[:, :2]) / 2)]:
        cache = m.new_kv_cache(3, kv_mode=mode)
        m(x[:, :2], kv_cache=cache)
        m(x[:, 2:], kv_cache=cache)  # the mean is written in at the start of this chunk
        layer = cache[m.config.n_prelude].layer_cache
        assert layer.length == 3
        keys = layer.k[0, :, :2].transpose(0, 1).reshape(2, 64)  # (tokens, heads * head_size)
        # the stored prompt keys are what the definition says (they came from cached passes whose
        # prompt was prefilled exactly, so they equal the uncached forward's)
        torch.testing.assert_close(keys, stored[0], atol=1e-5, rtol=1e-5)


def test_kv_mode_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="only 'per_step'"):
        tiny_model('gpt').new_kv_cache(8, kv_mode='mean')
    with pytest.raises(ValueError, match='unknown kv_mode'):
        tiny_model('grt').new_kv_cache(8, kv_mode='last')
    with pytest.raises(ValueError, match='needs use_cache=True'):
        tiny_model('grt').generate(torch.zeros(1, 2, dtype=torch.long), 2, use_cache=False, kv_mode='shared')


def test_clear_errors(grt_dir, tmp_path, capsys):
    with pytest.raises(SystemExit, match=r'error: no checkpoint at .*nothing/best\.pt \(nor ckpt\.pt\); train one'):
        run_sample(capsys, f'--out_dir={tmp_path / "nothing"}')
    os.makedirs(tmp_path / 'latest_only')
    shutil.copy(os.path.join(grt_dir, 'ckpt.pt'), tmp_path / 'latest_only' / 'ckpt.pt')
    with pytest.raises(SystemExit, match=r'error: no checkpoint at .*best\.pt, but ckpt\.pt is there: pick it with --ckpt=ckpt\.pt'):
        run_sample(capsys, f'--out_dir={tmp_path / "latest_only"}')
    with pytest.raises(SystemExit, match=r"error: .*'#'.*change --start"):
        run_sample(capsys, f'--out_dir={grt_dir}', '--start=to be # not')
    with pytest.raises(SystemExit, match='error: num_steps must be an integer >= 1'):
        run_sample(capsys, f'--out_dir={grt_dir}', '--num_steps=0')
    with pytest.raises(SystemExit, match="error: kv_mode 'last' is not available for this GRT; choose one of per_step, shared, mean"):
        run_sample(capsys, f'--out_dir={grt_dir}', '--kv_mode=last')
    with pytest.raises(SystemExit, match='error: unknown config key'):
        run_sample(capsys, f'--out_dir={grt_dir}', '--temprature=0.5')
    with pytest.raises(SystemExit, match='prompt file .* not found'):
        run_sample(capsys, f'--out_dir={grt_dir}', f'--start=FILE:{tmp_path / "none.txt"}')


def test_long_prompt_is_cropped_with_a_warning_and_file_prompt(grt_dir, tmp_path, capsys):
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('ab' * 50)  # 100 chars > block_size 64
    res = run_sample(capsys, f'--out_dir={grt_dir}', f'--start=FILE:{prompt}', '--max_new_tokens=5')
    assert 'warning: the prompt has 100 tokens, more than block_size 64' in res.err
    assert res.out.startswith('ab' * 32) and not res.out.startswith('ab' * 33)


def test_stream_decoder_holds_back_a_split_utf8_character():
    decode = lambda ids: bytes(ids).decode('utf-8', errors='replace')  # one token per byte
    stream = sample.StreamDecoder(decode)
    pieces = [stream.add(b) for b in 'né!'.encode()]
    assert pieces == ['n', '', 'é', '!']
    assert stream.flush() == ''
