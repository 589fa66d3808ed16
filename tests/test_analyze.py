"""analyze.py's measurements on tiny models, each against its definition written out here: the gate of
Eq. 5, the relative state change, the exit losses (at r = R the model's own val loss), the scale of e;
the script end to end on a tiny checkpoint, and its loss at R against the one training recorded."""

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from experiments import analyze
from conftest import CHARS, save_checkpoint, scramble, tiny_model
from prepare_data import write_tokens
from registry import build_model

B, T = 2, 24


def run(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def embed(model, idx):
    pos = torch.arange(idx.size(1))
    return model.transformer.wte(idx) + model.transformer.wpe(pos)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, len(CHARS), (B, T), generator=g)
    return x, torch.randint(0, len(CHARS), (B, T), generator=g)


def grt():
    return scramble(tiny_model('grt'), std=0.1)  # 1 + 1x4 + 1, gates that move


def written_out_grt(model, x, steps):
    """States h_0..h_steps and gates g_1..g_steps of Eq. 2-5 at eval (no noise), and e."""
    e = run(model.transformer.prelude, embed(model, x))
    h, states, gates = e, [e], []
    for _ in range(steps):
        o = run(model.transformer.core, model.W_proj(torch.cat([h, e], dim=-1)))
        x = torch.cat([model.ln_h(h), model.ln_e(e)], dim=-1)
        g = torch.sigmoid(model.gate_out(F.silu(model.gate_in(x))) / model.config.gate_tau)
        h = g * h + (1 - g) * o
        states.append(h)
        gates.append(g)
    return e, states, gates


@torch.no_grad()
def test_trace_records_the_states_and_gates_of_eq_2_to_5():
    model = grt()
    x, _ = batch()
    e, states, gates = written_out_grt(model, x, 6)
    with analyze.trace(model) as record:
        model(x, num_steps=6)
    torch.testing.assert_close(record['e'], e)
    assert len(record['states']) == 7 and len(record['gates']) == 6
    for mine, theirs in zip(record['states'] + record['gates'], states + gates):
        torch.testing.assert_close(mine, theirs)
    assert 'recurrence_step' not in vars(model) and not model.gate_out._forward_hooks  # left as it was


@torch.no_grad()
def test_measured_quantities_match_their_definitions():
    model = grt()
    data = [batch(0), batch(1)]
    result = analyze.measure(model, data, 8)  # R = 4: steps 5..8 run deeper than trained
    gate, change, loss, std = [[0.0] * 8 for _ in range(4)]
    for x, y in data:
        e, states, gates = written_out_grt(model, x, 8)
        for r in range(1, 9):
            gate[r - 1] += gates[r - 1].mean().item() / 2
            rel = (states[r] - states[r - 1]).norm(dim=-1) / states[r].norm(dim=-1)  # per token
            change[r - 1] += rel.mean().item() / 2
            std[r - 1] += states[r].std().item() / 2
            # exit loss: the coda reads h_r; it equals the model's loss at depth r
            logits = model.lm_head(model.transformer.ln_f(run(model.transformer.coda, states[r])))
            loss[r - 1] += F.cross_entropy(logits.view(-1, len(CHARS)), y.view(-1)).item() / 2
            assert F.cross_entropy(logits.view(-1, len(CHARS)), y.view(-1)).item() == pytest.approx(
                model(x, y, num_steps=r)[1].item(), abs=1e-5)
    for key, expected in (('gate', gate), ('change', change), ('exit_loss', loss), ('state_std', std)):
        assert result[key] == pytest.approx(expected, abs=1e-5), key
    assert result['e_std'] == pytest.approx(np.mean([written_out_grt(model, x, 1)[0].std().item() for x, _ in data]))
    # at r = R the exit loss is the model's own eval loss
    assert result['exit_loss'][3] == pytest.approx(np.mean([model(x, y)[1].item() for x, y in data]), abs=1e-5)
    assert 0 < min(result['gate']) and max(result['gate']) < 1 and min(result['change']) > 0


@torch.no_grad()
def test_models_without_a_gate_are_traced_too():
    """Huginn (the coda reads ln_f(h)) and a ladder rung: no gate, exit loss at R = eval loss."""
    for model_type, fields in (('huginn', dict(backprop_depth=2)), ('rung4', {})):
        torch.manual_seed(0)
        model = build_model(model_type, vocab_size=len(CHARS), block_size=64, n_embd=32, n_head=4, n_prelude=1,
                            n_core=1, n_coda=1, n_recur=3, **fields).eval()
        data = [batch(2)]
        result = analyze.measure(model, data, 4)
        assert result['gate'] == [None] * 4
        assert result['exit_loss'][2] == pytest.approx(model(*data[0])[1].item(), abs=1e-5)
        gate, change = analyze.token_map(model, data[0][0][:1], 4)
        assert gate is None and change.shape == (4, T)


@pytest.fixture(scope='module')
def char_data(tmp_path_factory):
    root = tmp_path_factory.mktemp('data')
    os.makedirs(root / 'tiny')
    tokens = np.random.default_rng(0).integers(len(CHARS), size=3000)
    write_tokens(str(root / 'tiny' / 'train.bin'), tokens[:2000])
    write_tokens(str(root / 'tiny' / 'val.bin'), tokens[2000:])
    with open(root / 'tiny' / 'meta.json', 'w') as f:
        json.dump({'tokenizer': 'char', 'vocab_size': len(CHARS), 'chars': CHARS}, f)
    return str(root)


def test_analyze_script_end_to_end(char_data, tmp_path):
    """On a checkpoint: tables, plots, the heatmap's text, and e's std at init from the same seed."""
    fields = dict(vars(tiny_model('grt').config))
    torch.manual_seed(5)  # as train.py seeds before building: analyze.py rebuilds the same weights
    model = build_model('grt', **fields)
    config = dict(dataset='tiny', data_dir=char_data, seed=5, block_size=32, batch_size=2, eval_iters=2)
    out_dir = save_checkpoint(str(tmp_path / 'out'), model, 'grt', config=config)
    img_dir = str(tmp_path / 'img')
    result = analyze.main([f'--out_dir={out_dir}', '--eval_iters=2', f'--img_dir={img_dir}', '--heatmap_chars=20',
                           '--text=To be, or not to be: that is'])
    assert len(result['gate']) == 8 and result['R'] == 4
    assert result['heatmap']['text'] == 'To be, or not to be:' and len(result['heatmap']['gate']) == 8
    assert all(len(row) == 20 for row in result['heatmap']['gate'])
    # the checkpoint holds the freshly built weights, so "at init" and "trained" measure the same model
    assert result['noise_scale']['init']['e_std'] == pytest.approx(result['noise_scale']['trained']['e_std'], rel=0.2)
    assert result['init']['gate'][:4] == pytest.approx(result['gate'][:4], abs=0.02)
    assert result['val_loss'] == pytest.approx(result['exit_loss'][3])
    with open(os.path.join(out_dir, 'analysis', 'analysis.json')) as f:
        assert json.load(f)['R'] == 4
    report = open(os.path.join(out_dir, 'analysis', 'analysis.md')).read()
    assert '| 4 (R) |' in report and report.startswith('# grt 1+1x4+1, iteration 100\n')  # no path: plots are committed
    pytest.importorskip('matplotlib')
    assert os.path.isfile(os.path.join(img_dir, 'grt_steps.png'))
    assert os.path.isfile(os.path.join(img_dir, 'grt_heatmap.png'))
    assert os.path.isfile(os.path.join(img_dir, 'grt_heatmap_change.png'))


def test_the_val_loss_at_r_is_the_one_training_recorded(char_data, tmp_path):
    """By default analyze evaluates on the val batches train.py's evaluation drew (the run's seed and
    eval_iters): its loss at R is best.pt's val_loss, and the report says so; other batches are named."""
    import train
    out_dir = str(tmp_path / 'run')
    train.main([f'--data_dir={char_data}', '--dataset=tiny', f'--out_dir={out_dir}', '--model_type=grt',
                '--n_prelude=1', '--n_core=1', '--n_coda=1', '--n_recur=3', '--n_embd=32', '--n_head=2',
                '--block_size=16', '--batch_size=4', '--gradient_accumulation_steps=1', '--max_iters=6',
                '--eval_interval=3', '--eval_iters=3', '--log_interval=3', '--learning_rate=3e-3',
                '--warmup_iters=1', '--compile=False', '--dtype=float32', '--device=cpu', '--peak_flops=1e12',
                '--seed=7'])
    recorded = torch.load(os.path.join(out_dir, 'best.pt'), weights_only=False)['val_loss']
    result = analyze.main([f'--out_dir={out_dir}', '--max_steps=3'])
    assert result['eval_iters'] == 3 and result['seed'] == 7
    assert result['val_loss'] == pytest.approx(recorded, abs=1e-6)
    report = open(os.path.join(out_dir, 'analysis', 'analysis.md')).read()
    assert f"training recorded {recorded:.4f} for these weights" in report
    other = analyze.main([f'--out_dir={out_dir}', '--max_steps=3', '--seed=8'])
    assert other['val_loss'] != pytest.approx(recorded, abs=1e-6)  # other batches, another loss
    assert "on other batches than training's evaluation (3 of seed 8 against its 3 of seed 7)" in \
        open(os.path.join(out_dir, 'analysis', 'analysis.md')).read()


def test_analyze_refuses_mor_and_dense_models(tmp_path):
    for model_type, fields in (('gpt', dict(n_layer=2)), ('mor', dict(n_prelude=1, n_core=1, n_coda=1, n_recur=2))):
        model = build_model(model_type, vocab_size=len(CHARS), block_size=32, n_embd=32, n_head=4, **fields)
        out_dir = save_checkpoint(str(tmp_path / model_type), model, model_type, config=dict(dataset='tiny'))
        with pytest.raises(SystemExit, match="traces a recurrent model's steps"):
            analyze.main([f'--out_dir={out_dir}'])


@torch.no_grad()
def test_plots_name_every_line_and_axis():
    """The steps plot: every line has a legend entry, and the one legend sits below the panels; the heatmap
    labels its character axis and shows newline and space as visible marks."""
    pytest.importorskip('matplotlib')
    result = analyze.measure(grt(), [batch(0)], 8)
    result.update(title='grt 1+1x4+1, iteration 100', init=dict(gate=[0.98] * 8))
    fig = analyze.plot_steps(result, 4)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ['trained', 'at initialisation', 'trained depth R = 4']
    assert len(fig.axes) == 3 and all(line.get_label() in legend for ax in fig.axes for line in ax.get_lines())
    fig.draw_without_rendering()
    assert fig.legends[0].get_window_extent().y1 < min(ax.get_tightbbox().y0 for ax in fig.axes)
    gate, _ = analyze.token_map(grt(), torch.tensor([[CHARS.index(ch) for ch in 'To be\n']]), 8)
    ax = analyze.plot_heatmap(gate, 'gate', list('To be\n'), 4, 'title').axes[0]
    assert ax.get_xlabel().startswith('character of the text') and ax.get_ylabel() == 'recurrence step (* = R)'
    assert [t.get_text() for t in ax.get_xticklabels()] == ['T', 'o', '\u2423', 'b', 'e', '\u21b5']
    assert ax.get_images()[0].get_array().shape == (8, 6)
