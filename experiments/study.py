"""
The paper's comparisons at laptop scale, on shakespeare_char, with one resumable command:

    python -m experiments.study                       # the whole study (see README for its wall time here)
    python -m experiments.study --sections=isoflop,depth --seeds=1 --iters=300   # a quick partial look
    python -m experiments.study --sections=tune       # pick each model's learning rate (run once; see LEARNING_RATES)

Each run is `python train.py config/study/recipe.py <model> --seed=S --max_iters=N --out_dir=...`, its output
kept in <out_dir>/runs/<run>/ (train.log, log.jsonl, ckpt.pt). A run with result.json is done and
never redone; a run with a checkpoint but no result.json resumes (--init_from=resume), so Ctrl-C and
rerun loses at most one evaluation interval. At the end it writes <out_dir>/RESULTS.md (tables) and,
when matplotlib is installed, loss_curves.png and depth.png.

Sections:
  isoflop   dense GPT, GRT, huginn, mor and ladder rung 2 at matched training FLOPs per token and
            matched tokens, `seeds` seeds each; MoR's eval routing (the fraction of tokens each
            recursion keeps) and the eval FLOPs it implies
  budget2x  dense and GRT with twice the tokens
  isoparam  dense against a GRT with a deeper shared core (the same unique blocks)
  depth     the trained isoFLOP GRT evaluated at R = 1 .. 2R
  ladder    the five rungs of the ablation ladder, all at matched training FLOPs (rung 2, plain
            recurrence, and rung 5, the GRT, are isoflop runs): the parts a rung lacks buy it more steps
  ladder_fixed  the five rungs at the GRT's own layout (R = 5, 3 unique blocks), FLOPs not matched:
            each step up the ladder adds one part and nothing else
  bench     bench.py's small and large decode tables
  tune      not in the default: every model of isoflop, isoparam, ladder and ladder_fixed trained once
            (seed tune_seed) at each learning rate of lr_grid; the best goes into LEARNING_RATES by hand,
            so the default study never retunes

Every run uses its model's rate from LEARNING_RATES (min_lr a tenth of it), else the recipe's. A gap
between two models is marked "clear" only when it exceeds twice their combined spread over seeds,
2 sqrt(std_a^2 + std_b^2).
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from tqdm import tqdm

import prepare_data
from bench import cpu_line
from common import Batches, fail, load_model, read_checkpoint, read_settings, rng_key, train_flops_per_token
from registry import build_model, from_checkpoint

DEFAULTS = dict(
    out_dir='results/study',
    data_dir='data',
    sections='isoflop,budget2x,isoparam,depth,ladder,ladder_fixed,bench',
    seeds=3,
    iters=800,  # iterations of one run (budget2x: twice); 12 x 64 = 768 tokens each; the default study fits 90 min
    depth_eval_iters=20,  # val batches (of the recipe's 12 x 64 tokens) per depth in the depth section
    lr_grid='1e-3,2e-3,4e-3,8e-3,1.6e-2',  # the tune section's rates (5e-4 was gpt's worst, 0.07 nats behind 1e-3)
    tune_seed=100,  # the tune section's one seed, apart from the seeds the tables report
    jobs=2,  # runs trained at once, each on an equal share of the cores: on 2 cores, two 1-thread runs
    # take about 1.15x the time of one 2-thread run (bf16, 128 wide), so 2 jobs finish the study 1.75x sooner
)
RECIPE = 'config/study/recipe.py'
SEQ_LEN = 64  # the recipe's block_size
TOKENS_PER_ITER = 12 * SEQ_LEN  # the recipe's batch_size x block_size

# The models, each as train.py model fields. Every model but grt_deep is matched to the 6-layer
# dense model in *training* FLOPs per token (within 3.5%, depth drawn as training draws it; see
# mean_train_flops and the table in RESULTS.md), so at eval depth the recurrent ones spend more.
MODELS = {
    'gpt': dict(model_type='gpt', n_layer=6),
    # 1 + 1x5 + 1: r ~ U{1..5} in training, mean 3 core passes + 2 unique blocks, plus W_proj and gate
    'grt': dict(model_type='grt', n_prelude=1, n_core=1, n_recur=5, n_coda=1),
    # heavy-tail depth: r_mean 4 (E[r] = 5 with the Poisson's +1), backprop through the last 3 steps
    'huginn': dict(model_type='huginn', n_prelude=1, n_core=1, n_recur=4, n_coda=1, backprop_depth=3),
    # middle-cycle sharing: unique first and last layers, the shared middle recursed 7 times, routed
    'mor': dict(model_type='mor', n_prelude=1, n_core=1, n_recur=7, n_coda=1),
    # the ablation ladder, each rung at the same training FLOPs (the parts it lacks buy more steps):
    'rung1': dict(model_type='rung1', n_prelude=0, n_core=1, n_recur=11, n_coda=0),  # recurrence alone
    'rung2': dict(model_type='rung2', n_prelude=1, n_core=1, n_recur=7, n_coda=1),  # + prelude/coda
    'rung3': dict(model_type='rung3', n_prelude=1, n_core=1, n_recur=7, n_coda=1),  # + state noise
    'rung4': dict(model_type='rung4', n_prelude=1, n_core=1, n_recur=6, n_coda=1),  # + re-injection
    # isoParam: the dense model's 6 unique blocks, 4 of them as a core run 3 times
    'grt_deep': dict(model_type='grt', n_prelude=1, n_core=4, n_recur=3, n_coda=1),
}
# The ladder at the GRT's own layout: R = 5 and its 3 unique blocks (rung 1 has no prelude or coda, so
# all 3 are in its core); training FLOPs differ from rung to rung (see the FLOPs table).
FIXED_LADDER_MODELS = {
    'rung1_fixed': dict(model_type='rung1', n_prelude=0, n_core=3, n_recur=5, n_coda=0),
    'rung2_fixed': dict(model_type='rung2', n_prelude=1, n_core=1, n_recur=5, n_coda=1),
    'rung3_fixed': dict(model_type='rung3', n_prelude=1, n_core=1, n_recur=5, n_coda=1),
    'rung4_fixed': dict(model_type='rung4', n_prelude=1, n_core=1, n_recur=5, n_coda=1),
}
LADDER = ['rung1', 'rung2', 'rung3', 'rung4', 'grt']  # rung 5 is the full GRT
FIXED_LADDER = ['rung1_fixed', 'rung2_fixed', 'rung3_fixed', 'rung4_fixed', 'grt']
SECTIONS = {  # section -> [(model, iterations multiplier)]
    'isoflop': [(m, 1) for m in ('gpt', 'grt', 'huginn', 'mor', 'rung2')],
    'budget2x': [('gpt', 2), ('grt', 2)],
    'isoparam': [('gpt', 1), ('grt_deep', 1)],
    'ladder': [(m, 1) for m in LADDER],
    'ladder_fixed': [(m, 1) for m in FIXED_LADDER],
}
REFERENCE = {'isoflop': 'gpt', 'budget2x': 'gpt', 'isoparam': 'gpt', 'ladder': None, 'ladder_fixed': None}
TUNED = ('isoflop', 'isoparam', 'ladder', 'ladder_fixed')  # the sections whose models the tune section tunes
# Each model's learning rate; a model not listed trains at the recipe's 1e-3. `python -m experiments.study
# --sections=tune` trains each model at every rate of lr_grid (seed tune_seed) and prints the best to put here.
LEARNING_RATES = {
    'gpt': 4e-3, 'grt': 8e-3, 'huginn': 4e-3, 'mor': 8e-3, 'rung2': 4e-3, 'grt_deep': 4e-3,
    'rung1': 4e-3, 'rung3': 2e-3, 'rung4': 4e-3,
    'rung1_fixed': 8e-3, 'rung2_fixed': 4e-3, 'rung3_fixed': 2e-3, 'rung4_fixed': 4e-3,
}


def spec(name):
    """A study model's train.py fields."""
    if name in MODELS:
        return MODELS[name]
    return FIXED_LADDER_MODELS[name]


def learning_rate(name):
    return LEARNING_RATES.get(name)


# -----------------------------------------------------------------------------
# FLOPs per token, each model by its own accounting


def model_of(name):
    fields = {k: v for k, v in spec(name).items() if k != 'model_type'}
    with torch.device('meta'):
        return build_model(spec(name)['model_type'], block_size=SEQ_LEN, vocab_size=65, n_embd=128,
                           n_head=4, **fields)


def mean_train_flops(model, seq_len=SEQ_LEN, draws=65536):
    """Mean training FLOPs per token over the depths training draws (seeded draws)."""
    gen = torch.Generator().manual_seed(0)
    return statistics.fmean(train_flops_per_token(model, seq_len, model.sample_depth(gen)) for _ in range(draws))


def flops_table(names):
    dense = model_of('gpt')
    dense_train, dense_infer = mean_train_flops(dense), dense.flops_per_token(SEQ_LEN)
    rows = ['| model | layout | unique params (non-emb.) | train FLOPs/token | x dense | inference FLOPs/token | x dense |',
            '|---|---|---|---|---|---|---|']
    for name in names:
        m = model_of(name)
        tr, inf = mean_train_flops(m), m.flops_per_token(SEQ_LEN)
        rows.append(f"| {name} | {layout(name)} | {m.get_num_params() / 1e6:.3f}M | {tr / 1e6:.2f}M | "
                    f"{tr / dense_train:.2f} | {inf / 1e6:.2f}M | {inf / dense_infer:.2f} |")
    return rows


def layout(name):
    f = spec(name)
    if f['model_type'] == 'gpt':
        return f"{f['n_layer']} layers"
    return f"{f['n_prelude']}+{f['n_core']}x{f['n_recur']}+{f['n_coda']}"


# -----------------------------------------------------------------------------
# Runs


def run_name(c, model, mult, seed, lr=None):
    """Named by its iterations and learning rate too (lr None: LEARNING_RATES', else the recipe's), so a
    study rerun with another --iters or rate never reuses a run."""
    lr = lr or learning_rate(model)
    return f"{model}-{c['iters'] * mult}it" + (f"-lr{lr:g}" if lr else '') + f"-s{seed}"


def run_training(c, model, mult, seed, runs_dir, lr=None):
    """Train one run to completion (resuming a started one); return its result dict. lr: the learning
    rate (None: LEARNING_RATES', else the recipe's), min_lr a tenth of it as in the recipe."""
    lr = lr or learning_rate(model)
    out = os.path.join(runs_dir, run_name(c, model, mult, seed, lr))
    result_path = os.path.join(out, 'result.json')
    if os.path.isfile(result_path):
        with open(result_path) as f:
            return json.load(f)
    os.makedirs(out, exist_ok=True)
    resume = os.path.isfile(os.path.join(out, 'ckpt.pt'))
    fields = [f"--{k}={v}" for k, v in spec(model).items()]
    fields += [f"--learning_rate={lr}", f"--min_lr={lr / 10}"] if lr else []
    cmd = [sys.executable, 'train.py', RECIPE, *fields, f"--seed={seed}", f"--max_iters={c['iters'] * mult}",
           f"--out_dir={out}", f"--data_dir={c['data_dir']}", f"--init_from={'resume' if resume else 'scratch'}"]
    threads = max(1, (os.cpu_count() or 1) // c['jobs'])  # runs trained at once share the cores
    with open(os.path.join(out, 'train.log'), 'a') as log:
        t0 = time.time()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if done.returncode != 0:
        fail(f"run {run_name(c, model, mult, seed, lr)} failed (exit {done.returncode}); see {out}/train.log, "
             f"then rerun experiments/study.py to continue")
    records = [json.loads(line) for line in open(os.path.join(out, 'log.jsonl'))]
    evals = [(r['iter'], r['tokens'], r['val_loss']) for r in records if 'val_loss' in r]
    result = dict(model=model, mult=mult, seed=seed, lr=lr, best_val_loss=min(v for _, _, v in evals),
                  final_val_loss=evals[-1][2], tokens=records[-1]['tokens'], train_time_s=records[-1]['time_s'],
                  wall_s=round(time.time() - t0, 1), evals=evals,
                  train_curve=[(r['tokens'], r['loss']) for r in records])
    with open(result_path + '.tmp', 'w') as f:
        json.dump(result, f)
    os.replace(result_path + '.tmp', result_path)
    return result


def train_all(c, runs, runs_dir, desc):
    """Train runs [(model, mult, seed, lr)], c['jobs'] at a time, longest first; return their results
    in the order given."""
    if c['jobs'] < 1:
        fail(f"jobs must be at least 1; got {c['jobs']}")
    results = {}
    with tqdm(total=sum(run[1] for run in runs), desc=desc, unit='run', disable=not runs) as bar, \
            ThreadPoolExecutor(c['jobs']) as pool:
        futures = {pool.submit(run_training, c, model, mult, seed, runs_dir, lr): (model, mult, seed, lr)
                   for model, mult, seed, lr in sorted(runs, key=lambda run: -run[1])}
        for future in as_completed(futures):
            run = futures[future]
            results[run] = future.result()
            bar.write(f"{run_name(c, *run)}: best val loss {results[run]['best_val_loss']:.4f}")
            bar.update(run[1])
    return [results[run] for run in runs]


@torch.no_grad()
def depth_losses(c, runs_dir, seed):
    """Val loss of the trained isoFLOP GRT at every R from 1 to 2R, on fixed validation batches."""
    path = os.path.join(runs_dir, run_name(c, 'grt', 1, seed), 'depth.json')
    if os.path.isfile(path):
        with open(path) as f:
            return {int(k): v for k, v in json.load(f).items()}
    ckpt = read_checkpoint(os.path.join(os.path.dirname(path), 'best.pt'))
    model = from_checkpoint(ckpt).eval()
    val = [prepare_data.read_tokens(p) for p in prepare_data.token_files(os.path.join(c['data_dir'], 'shakespeare_char'), 'val')]
    batches = Batches(val, SEQ_LEN, ckpt['config']['batch_size'], 'cpu')
    data = [batches.get(torch.Generator().manual_seed(rng_key(0, 'depth', k))) for k in range(c['depth_eval_iters'])]
    R = model.config.n_recur
    losses = {r: statistics.fmean(model(x, y, num_steps=r)[1].item() for x, y in data) for r in range(1, 2 * R + 1)}
    with open(path, 'w') as f:
        json.dump(losses, f)
    return losses


@torch.no_grad()
def mor_routing(c, runs_dir, seed):
    """The trained isoFLOP MoR at eval: the fraction of tokens each recursion keeps (its auxiliary
    routers decide) on fixed val batches, and the forward FLOPs per token that implies, against the
    training schedule's and the dense model's."""
    out = os.path.join(runs_dir, run_name(c, 'mor', 1, seed))
    path = os.path.join(out, 'routing.json')
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    model, ckpt = load_model('resume', out, 'cpu', 'best.pt')
    val = [prepare_data.read_tokens(p) for p in prepare_data.token_files(os.path.join(c['data_dir'], 'shakespeare_char'), 'val')]
    batches = Batches(val, SEQ_LEN, ckpt['config']['batch_size'], 'cpu')
    keep, flops = [], []
    for k in range(c['depth_eval_iters']):
        x, y = batches.get(torch.Generator().manual_seed(rng_key(0, 'routing', k)))
        model(x, y)
        keep.append(model.last_keep_fractions)
        flops.append(model.eval_flops_per_token(SEQ_LEN))
    routing = dict(keep=[statistics.fmean(step) for step in zip(*keep)], eval_flops=statistics.fmean(flops),
                   schedule_flops=model.flops_per_token(SEQ_LEN), dense_flops=model_of('gpt').flops_per_token(SEQ_LEN))
    with open(path, 'w') as f:
        json.dump(routing, f)
    return routing


def run_bench(scale, out_dir):
    """bench.py's table at one scale, kept as text; rerun only if missing."""
    path = os.path.join(out_dir, f'bench_{scale}.txt')
    if not os.path.isfile(path):
        done = subprocess.run([sys.executable, 'bench.py', f'--scale={scale}'], capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"bench.py --scale={scale} failed: {done.stderr.strip().splitlines()[-1:]}")
        with open(path + '.tmp', 'w') as f:
            f.write(done.stdout)
        os.replace(path + '.tmp', path)
    with open(path) as f:
        return f.read()


# -----------------------------------------------------------------------------
# Report


def stats(results, model, mult):
    """(mean, std or None, count) of a model's best val losses over seeds."""
    values = [r['best_val_loss'] for r in results if r['model'] == model and r['mult'] == mult]
    if not values:
        return None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None), len(values)


def gap(a, b):
    """(mean difference a - b, clear?): clear when |difference| > 2 sqrt(std_a^2 + std_b^2); None
    (undecided) with fewer than 2 seeds on either side."""
    difference = a[0] - b[0]
    if a[1] is None or b[1] is None:
        return difference, None
    return difference, abs(difference) > 2 * math.hypot(a[1], b[1])


def mean_spread(values):
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def loss_table(results, models, mult, reference=None):
    """One row per model: mean ± std over seeds and its gap to the reference model (None: to the row
    above, as up the ladder), marked clear or not."""
    rows = ['| model | layout | lr | best val loss (mean ± std) | seeds | gap to ' + (reference or 'the rung above')
            + ' | clear? | train time (s, mean) |', '|---|---|---|---|---|---|---|---|']
    previous = None
    for m in models:
        rs = [r for r in results if r['model'] == m and r['mult'] == mult]
        if not rs:
            continue
        mine = stats(results, m, mult)
        other = stats(results, reference, mult) if reference else previous
        difference, clear = gap(mine, other) if other and m != reference else (None, None)
        shown = '' if difference is None else f"{difference:+.4f}"
        mark = '' if difference is None else {True: '**clear**', False: 'no', None: 'n/a (1 seed)'}[clear]
        lr = rs[0].get('lr') or 'recipe'
        rows.append(f"| {m} | {layout(m)} | {lr} | {mean_spread([r['best_val_loss'] for r in rs])} | {len(rs)} | "
                    f"{shown} | {mark} | {statistics.fmean(r['train_time_s'] for r in rs):.0f} |")
        previous = mine
    return rows


def train_tokens(c):
    """Tokens in the training split (None if it is not there)."""
    files = prepare_data.token_files(os.path.join(c['data_dir'], 'shakespeare_char'), 'train')
    return sum(len(prepare_data.read_tokens(p)) for p in files) or None


def passes_line(c, mult):
    tokens = c['iters'] * mult * TOKENS_PER_ITER
    text = train_tokens(c)
    passes = f" = {tokens / text:.2f} passes over the {text:,}-token training text" if text else ''
    return f"A run trains on {c['iters'] * mult} x {TOKENS_PER_ITER} = {tokens:,} tokens{passes}."


def tune_table(c, tuning):
    """Best val loss per model and learning rate; the chosen (lowest) rate in bold."""
    grid = [float(x) for x in c['lr_grid'].split(',')]
    rows = [f"Every model once (seed {c['tune_seed']}, {c['iters']} iterations) at each rate; the lowest "
            f"best val loss (bold) is its rate in LEARNING_RATES.", '',
            '| model | ' + ' | '.join(f'lr {lr:g}' for lr in grid) + ' | chosen |', '|---|' + '---|' * (len(grid) + 1)]
    for model, losses in tuning.items():
        best = min(losses, key=losses.get)
        cells = [f"**{losses[lr]:.4f}**" if lr == best else f"{losses[lr]:.4f}" for lr in grid if lr in losses]
        edge = ' (edge of the grid: widen it)' if best in (min(grid), max(grid)) else ''
        rows.append(f"| {model} | " + ' | '.join(cells) + f" | {best:g}{edge} |")
    return rows


def mor_table(routing):
    n = len(next(iter(routing.values()))['keep'])
    rows = ['| seed | ' + ' | '.join(f'kept at recursion {s + 1}' for s in range(n)) +
            ' | eval FLOPs/token | x training schedule | x dense |', '|---|' + '---|' * (n + 3)]
    for seed, r in routing.items():
        rows.append(f"| {seed} | " + ' | '.join(f"{f:.3f}" for f in r['keep']) + f" | {r['eval_flops'] / 1e6:.2f}M | "
                    f"{r['eval_flops'] / r['schedule_flops']:.2f} | {r['eval_flops'] / r['dense_flops']:.2f} |")
    return rows


def plot_loss_curves(results):
    """One panel per section; in each, one line per model: the mean val loss over seeds, with a light
    band from the lowest to the highest seed. Legends sit below their panels, off the curves."""
    from matplotlib.figure import Figure
    titles = dict(isoflop='isoFLOPs', budget2x='twice the tokens', isoparam='isoParams',
                  ladder='ablation ladder, FLOP-matched', ladder_fixed='ablation ladder at R = 5')
    panels = [(s, runs) for s, runs in SECTIONS.items()
              if any(r['model'] == m and r['mult'] == mult for m, mult in runs for r in results)]
    fig = Figure(figsize=(4.6 * min(3, len(panels)), 4.6 * math.ceil(len(panels) / 3)), layout='constrained')
    axes = list(fig.subplots(math.ceil(len(panels) / 3), min(3, len(panels)), squeeze=False).flat)
    for ax, (section, runs) in zip(axes, panels):
        others = iter(f'C{i}' for i in range(2, 10))  # dense and GRT keep one colour in every panel
        for model, mult in runs:
            curves = [[(t, v) for _, t, v in r['evals']] for r in results if r['model'] == model and r['mult'] == mult]
            if not curves:
                continue
            n = min(len(c) for c in curves)  # the evaluations every seed has
            tokens = [t / 1e6 for t, _ in curves[0][:n]]
            losses = [[c[i][1] for c in curves] for i in range(n)]
            color = {'gpt': 'C0', 'grt': 'C1'}.get(model) or next(others)
            ax.plot(tokens, [statistics.fmean(v) for v in losses], marker='.', color=color,
                    label=f"{model} ({layout(model)}, {len(curves)} seed{'s' * (len(curves) > 1)})")
            ax.fill_between(tokens, [min(v) for v in losses], [max(v) for v in losses], color=color, alpha=0.2, lw=0)
        ax.set(xlabel='training tokens (millions)', ylabel='val loss', title=titles[section])
        ax.legend(loc='upper center', bbox_to_anchor=(0.5, -0.16), fontsize=8, frameon=False)
    for ax in axes[len(panels):]:  # the grid's unused cells
        ax.set_visible(False)
    fig.suptitle('shakespeare_char: val loss during training (line: mean over seeds; band: lowest to highest seed)')
    return fig


def plot_depth(depth):
    """The trained GRT's val loss against test-time depth, a line per seed; the legend below the axes."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 4.6), layout='constrained')
    ax = fig.subplots()
    for seed, losses in depth.items():
        ax.plot(list(losses), list(losses.values()), marker='o', label=f"GRT seed {seed}")
    ax.axvline(MODELS['grt']['n_recur'], color='gray', ls='--', label='trained R')
    ax.set(xlabel='test-time recurrence steps R', ylabel='val loss', title='GRT: val loss against test-time depth')
    ax.legend(loc='upper center', bbox_to_anchor=(0.5, -0.16), ncol=len(depth) + 1, fontsize='small', frameon=False)
    return fig


def plot(results, depth, out_dir):
    """loss_curves.png and depth.png (if depth) in out_dir; the names written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: tables only (pip install matplotlib for the plots)")
        return []
    figures = dict(loss_curves=plot_loss_curves(results) if results else None, depth=plot_depth(depth) if depth else None)
    for name, fig in figures.items():
        if fig is not None:
            fig.savefig(os.path.join(out_dir, f'{name}.png'), dpi=120)
    return [f'{name}.png' for name, fig in figures.items() if fig is not None]


def write_report(c, results, depth, benches, wall_s, out_dir, tuning=None, routing=None, sections=None):
    """RESULTS.md: the tables of the sections run (sections None: every section with results)."""
    run_minutes = sum(r['wall_s'] for r in results) / 60
    lines = ['# Study results', '',
             f"shakespeare_char (character level), recipe `{RECIPE}`, {c['iters']} iterations a run "
             f"(x2 in budget2x), {c['seeds']} seed(s), {c['jobs']} at a time. Machine: {cpu_line()}. Training runs "
             f"took {run_minutes:.1f} min of wall time in all; this invocation of `python -m experiments.study` "
             f"took {wall_s / 60:.1f} min (runs already done are not redone). A gap is **clear** when it exceeds "
             f"twice the combined spread over seeds, 2 sqrt(std_a^2 + std_b^2).", '']
    names = list(MODELS) + list(FIXED_LADDER_MODELS)
    lines += ['## Models and FLOPs (sequence length 64, LM head excluded)', ''] + flops_table(names) + ['']
    if tuning:
        lines += ['## Learning rates (the tune section)', ''] + tune_table(c, tuning) + ['']
    elif LEARNING_RATES:
        lines += ['## Learning rates', '', "Each model's rate is LEARNING_RATES' in experiments/study.py (each table's "
                  "lr column), min_lr a tenth of it; `python -m experiments.study --sections=tune` sweeps them.", '']
    for title, section, mult in (('isoFLOPs', 'isoflop', 1), ('Twice the tokens', 'budget2x', 2),
                                 ('isoParams', 'isoparam', 1), ('Ablation ladder, FLOP-matched', 'ladder', 1),
                                 ('Ablation ladder at the GRT layout (R = 5, 3 unique blocks)', 'ladder_fixed', 1)):
        rows = loss_table(results, [m for m, _ in SECTIONS[section]], mult, REFERENCE[section])
        if len(rows) > 2 and (sections is None or section in sections):
            lines += [f'## {title}', '', passes_line(c, mult), ''] + rows + ['']
    if routing:
        lines += ["## MoR at eval: the tokens each recursion keeps (auxiliary routers) and the FLOPs that cost", '',
                  "Training keeps (N_r - s) / N_r of the tokens at recursion s (expert choice); eval keeps what "
                  "the causal auxiliary routers say. FLOPs per token, forward, LM head excluded, at sequence "
                  "length 64.", ''] + mor_table(routing) + ['']
    if depth:
        lines += ['## Test-time depth (GRT trained with R = %d)' % MODELS['grt']['n_recur'], '',
                  '| R | ' + ' | '.join(f'seed {s}' for s in depth) + ' |', '|---|' + '---|' * len(depth)]
        for r in next(iter(depth.values())):
            lines.append(f'| {r} | ' + ' | '.join(f'{depth[s][r]:.4f}' for s in depth) + ' |')
        lines.append('')
    for scale, text in benches.items():
        lines += [f'## Decode benchmark, {scale} scale (`python bench.py --scale={scale}`)', '', '```',
                  *[l for l in text.splitlines() if not l.startswith('{')], '```', '']
    for name in plot(results, depth, out_dir):
        lines += [f'![{name}]({name})', '']
    with open(os.path.join(out_dir, 'RESULTS.md'), 'w') as f:
        f.write('\n'.join(lines))


def tune(c, runs_dir):
    """Train every tuned model once at each rate of lr_grid; write tune.json and tune.md; return
    {model: {lr: best val loss}}."""
    try:
        grid = [float(x) for x in c['lr_grid'].split(',')]
    except ValueError:
        fail(f"lr_grid must be comma-separated numbers, e.g. 1e-3,2e-3,4e-3; got {c['lr_grid']!r}")
    models = list(dict.fromkeys(m for s in TUNED for m, _ in SECTIONS[s]))
    runs = [(model, 1, c['tune_seed'], lr) for model in models for lr in grid]
    tuning = {m: {} for m in models}
    for (model, _, _, lr), result in zip(runs, train_all(c, runs, runs_dir, 'tune')):
        tuning[model][lr] = result['best_val_loss']
    chosen = {m: min(losses, key=losses.get) for m, losses in tuning.items()}
    with open(os.path.join(c['out_dir'], 'tune.json'), 'w') as f:
        json.dump(dict(grid=grid, seed=c['tune_seed'], iters=c['iters'], losses=tuning, chosen=chosen), f, indent=1)
    with open(os.path.join(c['out_dir'], 'tune.md'), 'w') as f:
        f.write('\n'.join(['# Learning rates', ''] + tune_table(c, tuning)) + '\n')
    print("chosen learning rates; record them in study.py's LEARNING_RATES:")
    print('LEARNING_RATES = {' + ', '.join(f"'{m}': {lr:g}" for m, lr in chosen.items()) + '}')
    return tuning


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    sections = [s for s in c['sections'].split(',') if s]
    known = (*SECTIONS, 'depth', 'bench', 'tune')
    unknown = [s for s in sections if s not in known]
    if unknown:
        fail(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    runs_dir = os.path.join(c['out_dir'], 'runs')
    os.makedirs(runs_dir, exist_ok=True)
    t0 = time.time()
    tuning = tune(c, runs_dir) if 'tune' in sections else None
    wanted = []
    for s in sections:
        for model, mult in SECTIONS.get(s, []) + ([('grt', 1)] if s == 'depth' else []):
            for seed in range(c['seeds']):
                if (model, mult, seed, None) not in wanted:
                    wanted.append((model, mult, seed, None))  # None: the model's rate in LEARNING_RATES
    results = train_all(c, wanted, runs_dir, 'study')
    depth = {seed: depth_losses(c, runs_dir, seed) for seed in range(c['seeds'])} if 'depth' in sections else {}
    routing = {seed: mor_routing(c, runs_dir, seed) for seed in range(c['seeds'])} if 'isoflop' in sections else {}
    benches = {scale: run_bench(scale, c['out_dir']) for scale in ('small', 'large')} if 'bench' in sections else {}
    if sections == ['tune']:  # tune.md is its report; RESULTS.md stays the last study's
        return
    write_report(c, results, depth, benches, time.time() - t0, c['out_dir'], tuning, routing, sections)
    print(f"wrote {os.path.join(c['out_dir'], 'RESULTS.md')} in {(time.time() - t0) / 60:.1f} min")


if __name__ == '__main__':
    main()
