"""
What a trained recurrent model does at each recurrence step, measured on validation text:

    python -m experiments.analyze --out_dir=out-shakespeare-char-grt            # reads out_dir/best.pt
    python -m experiments.analyze --out_dir=out-shakespeare-char-grt --img_dir=docs/img

Per recurrence step r = 1 .. 2R (R the trained depth; past R the model runs deeper than trained), on
the val batches train.py's evaluation of the run draws (the same keys: its seed and eval_iters), so the
loss at R is the val loss training recorded:
  gate      the mean gate value g of Eq. 5 over tokens and channels (GRT only; g near 1 keeps the state)
  change    the relative state change ||h_r - h_(r-1)|| / ||h_r||, per token (norms over channels), averaged
  exit loss the val loss when the coda reads h_r (at r = R: the model's own val loss)
and the scale of the state noise eps_x (std state_noise, Eq. 2) against the residual stream's std at the
prelude output e (= h_0 for GRT), at initialisation (the model rebuilt with the checkpoint's config and
seed, as train.py builds it) and after training.

It writes <analysis_dir>/analysis.json and analysis.md (tables), and, when matplotlib is installed,
<model_type>_steps.png (the three quantities per step), <model_type>_heatmap.png (a text's characters
against recurrence steps, coloured by the gate; GRT only) and <model_type>_heatmap_change.png (the same,
coloured by the relative state change) into img_dir.

The measurements hook the model from outside (trace below): the model's code is not changed for them.
Any RecurrentLM whose recur() calls recurrence_step works (GRT, the ladder rungs, Huginn); MoR routes
tokens per recursion and is not traced.
"""

import json
import os
import statistics
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from tqdm import tqdm

import prepare_data
from common import Batches, fail, load_model, read_settings, rng_key, share_cores
from model import GRT, RecurrentLM
from registry import build_model, model_type_of

DEFAULTS = dict(
    out_dir='out-shakespeare-char-grt',
    ckpt='best.pt',  # 'best.pt' (best val loss) or 'ckpt.pt' (the latest)
    data_dir='',  # '' = the checkpoint's data_dir
    analysis_dir='',  # tables go here; '' = <out_dir>/analysis
    img_dir='',  # plots go here; '' = analysis_dir
    eval_iters=0,  # val batches, of the run's batch_size x block_size tokens; 0 = the run's eval_iters
    max_steps=0,  # recurrence steps traced; 0 = 2R
    text='',  # the heatmap's text; '' = the start of the val split
    heatmap_chars=96,  # characters (tokens) in the heatmap
    device='cpu',
    seed=None,  # which val batches; None = the run's seed: with eval_iters=0, the batches training evaluated on
)


# -----------------------------------------------------------------------------
# Tracing one forward pass


@contextmanager
def trace(model):
    """Record, for the forward passes run inside the block: 'e' (the prelude output, of the last pass), 'states'
    ([h_0, h_1, ..., h_r], each (B, T, d)) and, for a GRT, 'gates' ([g_1, ..., g_r], the gate values
    of Eq. 5 at each step). recurrence_step is wrapped on this instance only and the gate read by a
    forward hook on f_g's last Linear, so GRT's code stays Eq. 2-5 as written."""
    if not isinstance(model, RecurrentLM):
        raise TypeError(f"{type(model).__name__} has no recurrence to trace")
    record = dict(e=None, states=[], gates=[])
    step = model.recurrence_step

    def recording_step(h, e, caches):
        if not record['states']:
            record['states'].append(h)
        record['e'] = e
        h = step(h, e, caches)
        record['states'].append(h)
        return h

    model.recurrence_step = recording_step
    hook = None
    if isinstance(model, GRT):  # f_g's output is the gate's logit; eval has no eps_g: g = sigmoid(logit / tau)
        hook = model.gate_out.register_forward_hook(
            lambda module, inputs, logit: record['gates'].append(torch.sigmoid(logit / model.config.gate_tau)))
    try:
        yield record
    finally:
        del model.recurrence_step  # back to the class's method
        if hook is not None:
            hook.remove()


def exit_logits(model, h):
    """The logits when the coda reads the state h, as the model's body and head compute them."""
    x = model.before_coda(h)
    for block in model.transformer.coda:
        x = block(x)
    return model.lm_head(model.transformer.ln_f(x))


def relative_change(new, old):
    """||h_r - h_(r-1)|| / ||h_r|| per token (norms over channels): (B, T)."""
    return (new - old).norm(dim=-1) / new.norm(dim=-1)


@torch.no_grad()
def measure(model, batches, max_steps, desc='measuring'):
    """Per step r = 1..max_steps: mean gate (GRT; else None), mean relative state change, exit loss,
    the std of h_r; and the std of the prelude output e. Averaged over the batches (lists of (x, y)),
    with a progress bar over them (desc)."""
    model.eval()
    gates, changes, losses, stds = ([[] for _ in range(max_steps)] for _ in range(4))
    e_std = []
    for x, y in tqdm(batches, desc=desc, unit='batch', dynamic_ncols=True):
        with trace(model) as record:
            model(x, num_steps=max_steps)
        states = record['states']
        e_std.append(record['e'].float().std().item())
        for r in range(1, max_steps + 1):
            changes[r - 1].append(relative_change(states[r], states[r - 1]).mean().item())
            stds[r - 1].append(states[r].float().std().item())
            logits = exit_logits(model, states[r])
            losses[r - 1].append(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item())
            if record['gates']:
                gates[r - 1].append(record['gates'][r - 1].mean().item())
    mean = statistics.fmean
    return dict(gate=[mean(g) if g else None for g in gates], change=[mean(c) for c in changes],
                exit_loss=[mean(l) for l in losses], state_std=[mean(s) for s in stds], e_std=mean(e_std))


@torch.no_grad()
def token_map(model, idx, max_steps):
    """(steps, T) maps of one text (idx (1, T)): the mean gate over channels per token and step (GRT;
    else None) and the relative state change per token and step."""
    model.eval()
    with trace(model) as record:
        model(idx, num_steps=max_steps)
    states = record['states']
    change = torch.stack([relative_change(states[r], states[r - 1])[0] for r in range(1, max_steps + 1)])
    gate = torch.stack([g[0].mean(dim=-1) for g in record['gates']]) if record['gates'] else None
    return gate, change


# -----------------------------------------------------------------------------
# Report


def plot_steps(result, R):
    """The gate, exit loss and state change against r, a panel each; one legend below the panels."""
    from matplotlib.figure import Figure
    steps = list(range(1, len(result['change']) + 1))
    panels = [('exit_loss', 'val loss when the coda reads h_r'), ('change', '||h_r - h_(r-1)|| / ||h_r||')]
    if result['gate'][0] is not None:
        panels.insert(0, ('gate', 'mean gate g (1 keeps h)'))
    fig = Figure(figsize=(4.2 * len(panels), 3.9), layout='constrained')
    lines = {}
    for ax, (key, label) in zip(fig.subplots(1, len(panels)), panels):
        lines['trained'], = ax.plot(steps, result[key], marker='o', label='trained')
        if result.get('init') and key == 'gate':
            lines['init'], = ax.plot(steps, result['init']['gate'], marker='.', ls=':', color='gray',
                                     label='at initialisation')
        lines['R'] = ax.axvline(R, color='gray', ls='--', lw=1, label=f'trained depth R = {R}')
        ax.set(xlabel='recurrence step r', title=label)
        ax.set_xticks(steps)
    fig.legend(handles=list(lines.values()), loc='outside lower center', ncol=len(lines), frameon=False)
    fig.suptitle(result['title'], fontsize=10)
    return fig


def plot_heatmap(values, label, chars, R, title):
    """values (steps, T) as colours, a row per recurrence step and a column per character of the text."""
    from matplotlib.figure import Figure
    steps, T = values.shape
    fig = Figure(figsize=(max(8.0, 0.13 * T), 0.35 * steps + 1.8), layout='constrained')
    ax = fig.subplots()
    im = ax.imshow(values.numpy(), aspect='auto', cmap='viridis', interpolation='nearest')
    ax.set_xticks(range(T))
    ax.set_xticklabels([{'\n': '\u21b5', ' ': '\u2423'}.get(ch, ch) for ch in chars], fontsize=7, family='monospace')
    ax.set_yticks(range(steps))
    ax.set_yticklabels([f'{r + 1}' + ('*' if r + 1 == R else '') for r in range(steps)], fontsize=7)
    ax.set(xlabel='character of the text (\u21b5 newline, \u2423 space)', ylabel='recurrence step (* = R)',
           title=title)
    fig.colorbar(im, ax=ax, label=label, fraction=0.03, pad=0.01)
    return fig


def val_loss_line(result):
    """The val loss at R, and how it relates to the one training recorded (best.pt's; ckpt.pt records none)."""
    line = f"Model val loss at R: {result['val_loss']:.4f}"
    rec = result['recorded']
    if (result['eval_iters'], result['seed']) != (rec['eval_iters'], rec['seed']):
        line += (f", on other batches than training's evaluation ({result['eval_iters']} of seed {result['seed']} "
                 f"against its {rec['eval_iters']} of seed {rec['seed']})")
        return line + (f", which recorded {rec['val_loss']:.4f}." if rec['val_loss'] is not None else ".")
    line += f", on the {rec['eval_iters']} val batches training evaluates on (seed {rec['seed']})"
    if rec['val_loss'] is None:
        return line + "."
    # the same batches: only arithmetic differs (training's autocast dtype and device against fp32 here)
    return line + f"; training recorded {rec['val_loss']:.4f} for these weights."


def markdown(result):
    lines = [f"# {result['title']}", '',
             f"{result['tokens']:,} val tokens ({result['eval_iters']} batches). R = {result['R']}: steps past R "
             f"run deeper than training did. {val_loss_line(result)}", '',
             '| step r | mean gate | at init | rel. state change | std of h_r | exit loss |', '|---|---|---|---|---|---|']
    init = result.get('init') or {}
    for r in range(len(result['change'])):
        gate = result['gate'][r]
        g0 = (init.get('gate') or [None] * (r + 1))[r]
        lines.append(f"| {r + 1}{' (R)' if r + 1 == result['R'] else ''} | "
                     f"{'-' if gate is None else f'{gate:.4f}'} | {'-' if g0 is None else f'{g0:.4f}'} | "
                     f"{result['change'][r]:.4f} | {result['state_std'][r]:.4f} | {result['exit_loss'][r]:.4f} |")
    lines += ['', '| residual stream at the prelude output | std of e | state_noise (std of eps_x) | noise / std |',
              '|---|---|---|---|']
    for when in ('init', 'trained'):
        scale = result['noise_scale'][when]
        noise = scale['state_noise']
        ratio = '-' if noise is None else f"{noise / scale['e_std']:.3f}"
        lines.append(f"| {when} | {scale['e_std']:.4f} | {'-' if noise is None else noise} | {ratio} |")
    return '\n'.join(lines) + '\n'


def val_batches(checkpoint, data_dir, eval_iters, seed, device, block_size):
    """(eval_iters val batches drawn as train.py's estimate_loss draws them, from keys (seed, 'eval', 'val', k),
    the val token files). block_size: the model's, where the run did not set a shorter window."""
    c = checkpoint['config']
    root = os.path.join(data_dir or c.get('data_dir', 'data'), c['dataset'])
    files = prepare_data.token_files(root, 'val')
    if not files:
        fail(f"no val tokens in {root}; prepare the dataset first (python prepare_data.py --name={c['dataset']})")
    val = [prepare_data.read_tokens(p) for p in files]
    batches = Batches(val, c.get('block_size') or block_size, c['batch_size'], device)
    keys = [rng_key(seed, 'eval', 'val', k) for k in range(eval_iters)]
    return [batches.get(torch.Generator().manual_seed(key)) for key in keys], val


def fresh_model(checkpoint):
    """The model as train.py built it before training: the same config, the same seed."""
    torch.manual_seed(checkpoint['config']['seed'])
    return build_model(checkpoint['model_type'], **checkpoint['model_args']).eval()


def analyze(c):
    share_cores(c['device'])  # torch's threads on the cores other work leaves free
    model, checkpoint = load_model('resume', c['out_dir'], c['device'], c['ckpt'])
    if not isinstance(model, RecurrentLM) or model_type_of(model) == 'mor':
        fail(f"analyze.py traces a recurrent model's steps; {c['out_dir']} holds a {model_type_of(model)!r} "
             f"(use grt, huginn or a ladder rung)")
    R = model.config.n_recur
    max_steps = c['max_steps'] or 2 * R
    if max_steps < R:
        fail(f"max_steps={max_steps} is below the trained R = {R}; pass --max_steps={R} or more (0 = 2R)")
    run = checkpoint['config']
    eval_iters, seed = c['eval_iters'] or run['eval_iters'], run['seed'] if c['seed'] is None else c['seed']
    batches, val = val_batches(checkpoint, c['data_dir'], eval_iters, seed, c['device'], model.config.block_size)
    result = measure(model, batches, max_steps, desc=f"trained model, {max_steps} steps")
    init_model = fresh_model(checkpoint).to(c['device'])
    init = measure(init_model, batches[:max(1, len(batches) // 4)], max_steps, desc="the same model at init")
    noise = getattr(model.config, 'state_noise', None)
    result.update(  # no path in the title: it goes into committed plots
        title=f"{model_type_of(model)} {model.config.n_prelude}+{model.config.n_core}x{R}+{model.config.n_coda}, "
              f"iteration {checkpoint.get('iter_num')}",
        R=R, val_loss=result['exit_loss'][R - 1],  # the coda reading h_R is the model's own forward
        eval_iters=len(batches), seed=seed, tokens=sum(x.numel() for x, _ in batches),
        recorded=dict(val_loss=checkpoint.get('val_loss'), eval_iters=run['eval_iters'], seed=run['seed']),
        init=dict(gate=init['gate'], change=init['change'], state_std=init['state_std']),
        noise_scale=dict(init=dict(e_std=init['e_std'], state_noise=noise),
                         trained=dict(e_std=result.pop('e_std'), state_noise=noise)))

    # the heatmap's text
    meta = checkpoint.get('meta') or {}
    encode, decode = prepare_data.get_tokenizer(meta) if meta else (None, None)
    T = min(c['heatmap_chars'], model.config.block_size)
    if c['text']:
        if encode is None:
            fail("the checkpoint has no tokenizer (meta); leave --text empty to use the val split")
        ids = encode(c['text'])[:T]
    else:
        ids = [int(t) for t in val[0][:T]]
    idx = torch.tensor([ids], device=c['device'])
    gate_map, change_map = token_map(model, idx, max_steps)
    chars = [decode([i]) for i in ids] if decode else [str(i) for i in ids]
    result['heatmap'] = dict(text=''.join(chars), gate=None if gate_map is None else gate_map.tolist(),
                             change=change_map.tolist())

    analysis_dir = c['analysis_dir'] or os.path.join(c['out_dir'], 'analysis')
    img_dir = c['img_dir'] or analysis_dir
    os.makedirs(analysis_dir, exist_ok=True)
    os.makedirs(img_dir, exist_ok=True)
    with open(os.path.join(analysis_dir, 'analysis.json'), 'w') as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(analysis_dir, 'analysis.md'), 'w') as f:
        f.write(markdown(result))
    print(markdown(result))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: tables only (pip install matplotlib for the plots)")
        return result
    name = model_type_of(model)
    figures = {f'{name}_steps.png': plot_steps(result, R)}
    for suffix, values, label in [('heatmap', gate_map, 'mean gate g over channels (1 keeps the state)'),
                                  ('heatmap_change', change_map, '||h_r - h_(r-1)|| / ||h_r||')]:
        if values is not None:
            figures[f'{name}_{suffix}.png'] = plot_heatmap(values.cpu(), label, chars, R,
                                                           f"{result['title']}: {label} per character and step")
    for file, fig in figures.items():
        fig.savefig(os.path.join(img_dir, file), dpi=120)
    print(f"wrote {analysis_dir}/analysis.md, analysis.json; in {img_dir}: {', '.join(figures)}")
    return result


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    return analyze(c)


if __name__ == '__main__':
    main()
