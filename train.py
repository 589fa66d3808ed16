"""
Train a dense GPT-2 or a Gated Recurrent Transformer (GRT), on one device or many, in nanoGPT's order:
settings, DDP, data, model, optimizer, compile, evaluation, learning rate, the loop.

    python train.py config/shakespeare_char_grt.py                  # the quick start, on a CPU
    python train.py config/grt_small.py --init_from=resume         # continue exactly where it stopped
    torchrun --standalone --nproc_per_node=8 train.py config/grt_small.py

Config files and --key=value set the settings below (config/__init__.py). out_dir receives log.jsonl,
ckpt.pt (the latest state, for resume) and best.pt (the best val loss); a new run refuses an out_dir
that holds them unless --overwrite=True. Every micro-step reseeds its randomness from (seed, iteration,
micro-step) (common.rng_key): the depth r, the batch, the dropout and noise. So a resumed run repeats
the uninterrupted one exactly (on a CPU, on the thread count ckpt.pt records), and evaluation never
shifts the stream.
"""

import json
import math
import os
import sys
import time
from dataclasses import MISSING, asdict, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import prepare_data
from common import (CPU_BF16_MIN_WIDTH, BarLines, Batches, TrainingMFU, autocast_context, compile_regions,
                    cpu_bf16_speedup, fail, from_pretrained, open_log, pick_device, pick_dtype, read_checkpoint,
                    read_settings, resolve_compile, resume_threads, rng_key, save_checkpoint, share_cores,
                    stop_signals_between_iterations)
from registry import MODELS, PRESETS, build_model, foreign_fields, from_checkpoint, model_type_of

# -----------------------------------------------------------------------------
# Settings: every key a config file or --key=value may set

TRAIN_DEFAULTS = dict(
    # I/O
    out_dir='out',
    eval_interval=1000,  # evaluate, write ckpt.pt (and best.pt if val loss improved) every this many iterations
    eval_iters=100,  # batches per split and evaluation, shared among DDP ranks
    log_interval=10,  # a log.jsonl line and a progress-bar update every this many iterations
    eval_only=False,  # evaluate once and exit
    init_from='scratch',  # 'scratch', 'resume' (from out_dir/ckpt.pt) or 'gpt2', 'gpt2-medium', ...
    overwrite=False,  # a new run (not resume) into an out_dir holding ckpt.pt or best.pt: True replaces them, else refused
    # data
    dataset='fineweb10B',  # a folder of data_dir (prepare_data.py), or 'task:NAME' (experiments/depth_tasks.py)
    data_dir='data',
    difficulty=4,  # dataset='task:NAME': train and validate on answers that need 1..difficulty steps
    input_difficulty=0,  # dataset='task:NAME': queries need 1..this many steps, longer ones unscored (0: difficulty)
    batch_size=16,  # micro-batch per device
    gradient_accumulation_steps=32,  # micro-steps per optimizer step, over all DDP ranks together
    # model: model_type and its fields, or a preset (the model fields follow, None = unset)
    model_type='',  # a key of registry.MODELS; '' = the preset's, else 'gpt'
    preset='',  # a key of registry.PRESETS, e.g. 'grt-small-isoflop'
    # AdamW, warmup, then cosine decay
    learning_rate=6e-4,
    max_iters=20000,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # clip the global gradient norm at this value; 0 disables
    decay_lr=True,
    warmup_iters=2000,
    lr_decay_iters=0,  # iterations of cosine decay to min_lr; 0 = max_iters
    min_lr=6e-5,
    final_gate_noise=-1.0,  # a GRT's eps_g std: linear from gate_noise to this over lr_decay_iters; < 0: constant
    # system
    device='auto',  # 'auto' (cuda > mps > cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype='auto',  # 'auto', 'float32', 'bfloat16' or 'float16' (CUDA only, with a GradScaler)
    compile=None,  # True, False, or None / 'auto': only on CUDA at n_embd >= 256 (common.compile_regions)
    seed=1337,
    peak_flops=0.0,  # per-device peak for MFU; 0 = measured (CPU) or the datasheet's (CUDA)
)
MODEL_FIELDS = sorted({f.name for config_class, _ in MODELS.values() for f in fields(config_class)})
DEFAULTS = {**TRAIN_DEFAULTS, **{name: None for name in MODEL_FIELDS}}

# -----------------------------------------------------------------------------
# The run, in nanoGPT's order; the pieces it calls follow it


def train(c):
    """Train as the settings c say; return {'iter_num', 'best_val_loss', 'val_loss'}."""
    for key in ('eval_interval', 'eval_iters', 'log_interval', 'batch_size', 'gradient_accumulation_steps'):
        if c[key] < 1:
            fail(f"{key} must be >= 1, got {c[key]}")

    # a new run never writes over another's checkpoints unless told to
    held = [n for n in ('ckpt.pt', 'best.pt') if os.path.isfile(os.path.join(c['out_dir'], n))]
    if held and c['init_from'] != 'resume' and not c['eval_only']:
        if not c['overwrite']:
            fail(f"{c['out_dir']} holds a run ({' and '.join(held)}): continue it with --init_from=resume, "
                 f"pick another --out_dir, or replace it with --overwrite=True")
        if int(os.environ.get('RANK', 0)) == 0:  # the new run's files only, never a mix of two runs
            for name in held:
                os.remove(os.path.join(c['out_dir'], name))

    # DDP: one process, or one of torchrun's (it sets RANK, LOCAL_RANK and WORLD_SIZE)
    ddp = 'RANK' in os.environ and 'WORLD_SIZE' in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
    master = rank == 0
    device = pick_device(c['device'], local_rank)
    device_type = device.split(':')[0]
    if c['init_from'] != 'resume':  # a resumed run takes its checkpoint's thread count (resume_threads, below)
        share_cores(device)  # torch's threads on the free cores; under torchrun OMP_NUM_THREADS=1 decides
    if ddp:
        if device_type == 'cuda':
            torch.cuda.set_device(device)
        dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo')
    if c['gradient_accumulation_steps'] % world:
        fail(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by the "
             f"{world} processes; it counts micro-steps over all ranks together")
    accum = c['gradient_accumulation_steps'] // world  # this rank's micro-steps
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if c['dtype'] != 'auto':  # a wrong dtype stops (a slow one warns) before any download
        pick_dtype(c['dtype'], device_type, warn=master)

    # data: the token files (or a depth task); the windows are read once block_size is known
    meta, data = load_data(c, device, master)

    # model
    ckpt_path, best_path = os.path.join(c['out_dir'], 'ckpt.pt'), os.path.join(c['out_dir'], 'best.pt')
    if master:
        print({'scratch': "initializing a new model", 'resume': f"resuming from {ckpt_path}"}.get(
            c['init_from'], f"loading pretrained {c['init_from']}"), flush=True)
    model, ckpt = init_model(c, meta, ckpt_path)
    if ckpt is not None:
        resume_threads(device, ckpt.get('threads'), verbose=master)
    model_type = model_type_of(model)
    dtype = pick_dtype(c['dtype'], device_type, warn=False, n_embd=model.config.n_embd)  # 'auto' by width
    if ddp and device_type == 'cpu':  # each rank measured its own bf16 speed: all train in rank 0's choice
        choice = [dtype]
        dist.broadcast_object_list(choice, src=0)
        dtype = choice[0]
    ctx = autocast_context(device_type, dtype)
    block_size = c['block_size'] or model.config.block_size  # may be shorter than a GPT-2's 1024
    if block_size > model.config.block_size:
        fail(f"block_size={block_size} exceeds the model's {model.config.block_size}; lower it")
    model.to(device)
    batches = data if 'task' in meta else {split: Batches(shards, block_size, c['batch_size'], device)
                                           for split, shards in data.items()}
    tokens_per_iter = c['batch_size'] * block_size * accum * world

    # optimizer, and the state a resumed run continues from
    optimizer = model.configure_optimizers(c['weight_decay'], c['learning_rate'], (c['beta1'], c['beta2']),
                                           device_type)
    scaler = torch.amp.GradScaler('cuda', enabled=dtype == 'float16')  # fp16 only; otherwise it does nothing
    iter_num, best_val_loss, tokens, time_before = 0, math.inf, 0, 0.0  # time_before: the resumed runs' seconds
    if ckpt is not None:  # no generator states: every draw is reseeded from its key
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        iter_num, best_val_loss, tokens, time_before = (ckpt[k] for k in ('iter_num', 'best_val_loss', 'tokens',
                                                                          'time_s'))
        ckpt = None  # free the memory

    # compile by regions (each block once, on first use: the first iterations are slow), then DDP
    compiled, compile_note = resolve_compile(c['compile'], device_type, model.config.n_embd)
    start_gate_noise = check_gate_noise_ramp(c, model, compiled)
    if compiled:
        compile_regions(model)
    trained = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None) if ddp else model
    run_mfu = None  # rank 0's MFU at each log line (common.TrainingMFU)
    if master:
        resumed = f"; from iteration {iter_num}" if iter_num else ""
        print(f"{model_type} model, {model.get_num_params() / 1e6:.2f}M non-embedding parameters; {device}, "
              f"{dtype}, compile={compiled}, {world} process(es); {tokens_per_iter:,} tokens per iteration{resumed}")
        if compile_note:
            print(compile_note)
        if device_type == 'cpu' and c['dtype'] == 'auto' and model.config.n_embd >= CPU_BF16_MIN_WIDTH:
            print(f"dtype='auto' chose {dtype}: bf16 matrix products measured {cpu_bf16_speedup():.2f}x as fast "
                  "as fp32 on this CPU")
        run_mfu = TrainingMFU(device, dtype, c['peak_flops'], verbose=True)

    tty = sys.stderr.isatty()  # else a file: the bar as a line every 30 s, no evaluation bar

    @torch.no_grad()
    def estimate_loss():
        """Mean loss over eval_iters fixed batches per split (the same every time), shared among the
        ranks; its own generators, so it never shifts the training stream. On a terminal a bar counts the batches."""
        model.eval()
        out, mine = {}, range(rank, c['eval_iters'], world)
        with tqdm(total=2 * len(mine), leave=False, disable=not (master and tty), dynamic_ncols=True,
                  unit='batch') as bar:
            for split, source in batches.items():
                bar.set_description(f"evaluating {split}")
                total = torch.zeros(2, device=device)  # sum of losses, number of batches
                for k in mine:
                    x, y = source.get(torch.Generator().manual_seed(rng_key(c['seed'], 'eval', split, k)))
                    with ctx:
                        _, loss = model(x, y)
                    total += torch.stack([loss.float(), torch.ones((), device=device)])
                    bar.update(1)
                if ddp:
                    dist.all_reduce(total)
                out[split] = (total[0] / total[1]).item()
        model.train()
        return out

    def checkpoint_state(val_loss=None):
        """best.pt's (given val_loss): the weights and what describes them; else ckpt.pt's: all resume needs."""
        args = dict(asdict(model.config), **({} if start_gate_noise is None else {'gate_noise': start_gate_noise}))
        state = dict(model_type=model_type, model_args=args, model=model.state_dict(),
                     meta=meta, config=c, iter_num=iter_num)
        if val_loss is not None:
            return dict(state, val_loss=val_loss)
        return dict(state, optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                    best_val_loss=best_val_loss, tokens=tokens, time_s=time_before + time.time() - started,
                    threads=torch.get_num_threads())  # a CPU run resumes on as many, for the same sums

    def stop_non_finite(what, value):
        kept = (f"the last good checkpoint {ckpt_path} is kept" if os.path.isfile(ckpt_path)
                else "no checkpoint was written")
        fail(f"{what} is {value} at iteration {iter_num}; training stopped and {kept}; "
             f"lower learning_rate, raise warmup_iters or use dtype=float32")

    if c['eval_only']:
        losses = estimate_loss()
        if master:
            print(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        return dict(iter_num=iter_num, best_val_loss=best_val_loss, val_loss=losses['val'])

    # the loop
    data_gen, depth_gen = torch.Generator(), torch.Generator()  # reseeded for every batch and micro-step

    def get_batch(it, micro):
        """This rank's batch for micro-step micro of iteration it, keyed on the global micro-step, so
        2 ranks x 1 micro-step read what 1 rank x 2 would."""
        data_gen.manual_seed(rng_key(c['seed'], 'data', it, rank * accum + micro))
        return batches['train'].get(data_gen)

    # torch.manual_seed seeds every backend, a cost each micro-step; a CPU has one generator to seed
    seed = torch.default_generator.manual_seed if device_type == 'cpu' else torch.manual_seed
    log = open_log(c, iter_num) if master else None
    bar = tqdm(total=c['max_iters'], initial=iter_num, disable=not master, dynamic_ncols=True,
               desc='compiling' if compiled else 'train',
               **({} if tty else dict(file=BarLines(sys.stderr), mininterval=30, maxinterval=30)))
    losses, since, window = None, 0, []
    started = t_log = time.time()
    x, y = get_batch(iter_num, 0)
    with stop_signals_between_iterations(ddp, device) as stop_requested:
        try:
            while iter_num < c['max_iters']:
                if stop_requested():
                    raise KeyboardInterrupt
                lr = get_lr(iter_num, c)
                for group in optimizer.param_groups:
                    group['lr'] = lr
                if start_gate_noise is not None:
                    model.config.gate_noise = get_gate_noise(iter_num, c, start_gate_noise)
                if hasattr(model, 'set_iteration'):  # a schedule inside the model (MoR's capacity warm-up)
                    model.set_iteration(iter_num)
                loss_sum, depths = torch.zeros((), device=device), []
                for micro in range(accum):
                    # r, then the dropout and noise of this micro-step, drawn outside any compiled region
                    depth_gen.manual_seed(rng_key(c['seed'], 'depth', iter_num, micro))
                    num_steps = model.sample_depth(depth_gen)
                    seed(rng_key(c['seed'], 'noise', rank, iter_num, micro))
                    if ddp:  # all-reduce the gradients only on the last micro-step
                        trained.require_backward_grad_sync = micro == accum - 1
                    with ctx:
                        _, loss = trained(x, y, num_steps=num_steps)
                        loss = loss / accum
                    # the next batch, read while the device works
                    x, y = get_batch(iter_num, micro + 1) if micro + 1 < accum else get_batch(iter_num + 1, 0)
                    scaler.scale(loss).backward()
                    loss_sum += loss.detach()
                    if num_steps is not None:
                        depths.append(num_steps)
                if c['grad_clip'] > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), c['grad_clip'])
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

                # log (loss.item(), a host-device sync, only here), evaluate and save
                iter_num, tokens, since, window = iter_num + 1, tokens + tokens_per_iter, since + 1, window + depths
                if compiled and since == 1:
                    bar.set_description('train', refresh=False)
                bar.update(1)
                evaluating = iter_num % c['eval_interval'] == 0 or iter_num == c['max_iters']
                if iter_num % c['log_interval'] and not evaluating:
                    continue
                dt = (time.time() - t_log) / since
                if ddp:
                    dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # every rank logs the same loss
                lossf = loss_sum.item()
                if not math.isfinite(lossf):
                    stop_non_finite('loss', lossf)
                depth = sum(window) / len(window) if window else None
                mfu = run_mfu(model, tokens_per_iter // world, dt, block_size, depth) if master else None
                r = None if not depths else depths[0] if len(depths) == 1 else sum(depths) / len(depths)
                record = dict(iter=iter_num, loss=lossf, lr=lr, r=r, tokens=tokens, time_s=round(
                    time_before + time.time() - started, 3), mfu=None if mfu is None else round(mfu, 5))
                bar.set_postfix(dict(loss=f"{lossf:.4f}", tok_s=f"{tokens_per_iter / dt:,.0f}",
                                     **({} if mfu is None else {'mfu': f"{100 * mfu:.1f}%"})), refresh=False)
                if evaluating:
                    paused = time.time()
                    losses = estimate_loss()
                    if not math.isfinite(losses['val']):
                        stop_non_finite('val loss', losses['val'])
                    improved, best_val_loss = losses['val'] < best_val_loss, min(best_val_loss, losses['val'])
                    record.update(val_loss=losses['val'], eval_train_loss=losses['train'])
                    if master:
                        bar.write(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                        bar.set_description(f"saving {' and '.join([best_path] * improved + [ckpt_path])}")
                        if improved:
                            save_checkpoint(best_path, checkpoint_state(losses['val']))
                        save_checkpoint(ckpt_path, checkpoint_state())
                        bar.set_description('train', refresh=False)
                        bar.last_print_t += time.time() - paused  # the ETA's rate counts iterations, not this
                if log:
                    log.write(json.dumps(record) + '\n')
                    log.flush()
                since, window, t_log = 0, [], time.time()
        except KeyboardInterrupt:
            bar.close()
            if master and iter_num > 0 and all(torch.isfinite(p).all() for p in model.parameters()):
                print(f"\ninterrupted at iteration {iter_num}: saving {ckpt_path} ...", flush=True)
                save_checkpoint(ckpt_path, checkpoint_state())
                print(f"saved {ckpt_path}; continue with --init_from=resume")
            elif master:
                print(f"\ninterrupted at iteration {iter_num}: nothing saved")
            sys.exit(130)
        finally:  # on every way out: an open bar left for exit would print itself after the caller's output
            bar.close()
            if log:
                log.close()
    if master and losses is not None:
        print(f"done: {iter_num} iterations, {tokens:,} tokens, {time_before + time.time() - started:.0f} s of "
              f"training; best val loss {best_val_loss:.4f} in {best_path}, the latest state in {ckpt_path}")
    elif master:
        print(f"nothing to train: {ckpt_path} is at iteration {iter_num}, max_iters is {c['max_iters']}; "
              f"raise max_iters to continue")
    return dict(iter_num=iter_num, best_val_loss=best_val_loss, val_loss=losses and losses['val'])

# -----------------------------------------------------------------------------
# Data: token files read as memmaps in random windows (common.Batches), or a depth task


def load_data(c, device, master):
    """(meta, {'train': ..., 'val': ...}): each split's token files, or for dataset='task:NAME' the
    batch sources of that depth task. shakespeare_char is prepared on the first run."""
    if c['dataset'].startswith('task:'):
        from experiments.depth_tasks import task_batches
        if not c['block_size']:
            fail(f"dataset={c['dataset']!r} needs a block_size; set e.g. --block_size=128")
        train_source, val_source = task_batches(c['dataset'][5:], c['block_size'], c['batch_size'], device,
                                                c['seed'], c['difficulty'], c['input_difficulty'])
        return {'task': c['dataset'], 'vocab_size': train_source.vocab_size}, {'train': train_source, 'val': val_source}
    data_dir = os.path.join(c['data_dir'], c['dataset'])
    try:
        if c['dataset'] == 'shakespeare_char' and not os.path.isfile(os.path.join(data_dir, 'meta.json')):
            if master:  # prepare_data says what it reads or downloads
                prepare_data.prepare('shakespeare_char', data_dir=c['data_dir'])
            if dist.is_initialized():
                dist.barrier()
        meta = prepare_data.load_meta(data_dir)
        return meta, {split: [prepare_data.read_tokens(p) for p in prepare_data.token_files(data_dir, split)]
                      for split in ('train', 'val')}
    except ValueError as e:
        fail(e)

# -----------------------------------------------------------------------------
# The model: from the config, a checkpoint or pretrained GPT-2


def requested_model(c, meta):
    """(model_type, fields) the config asks for: a preset, then the fields set explicitly, then the
    dataset's vocab_size unless set. model_type is '' when the config names none."""
    args, model_type = {}, c['model_type']
    if c['preset']:
        if c['preset'] not in PRESETS:
            fail(f"unknown preset {c['preset']!r}; known presets: {', '.join(PRESETS)}")
        args = dict(PRESETS[c['preset']])
        preset_type = args.pop('model_type')
        if model_type and model_type != preset_type:
            fail(f"model_type={model_type!r} conflicts with preset {c['preset']!r} (a {preset_type!r}); drop one")
        model_type = preset_type
    if model_type and model_type not in MODELS:
        fail(f"unknown model_type {model_type!r}; known: {', '.join(MODELS)}")
    explicit = {k: c[k] for k in MODEL_FIELDS if c[k] is not None}
    for f in fields(MODELS[model_type or 'gpt'][0]):
        if f.name in explicit and f.default not in (None, MISSING) and not same_type(explicit[f.name], f.default):
            fail(f"config key {f.name!r} must be {type(f.default).__name__}, got {explicit[f.name]!r}")
    if model_type or c['init_from'] != 'resume':
        foreign = foreign_fields(model_type or 'gpt', explicit)
        if foreign:
            fail(f"{foreign}; leave out what does not apply, or set model_type")
    args.update(explicit)
    if 'vocab_size' not in explicit:
        args['vocab_size'] = meta['vocab_size']  # the dataset's vocabulary over any preset's
    elif explicit['vocab_size'] < meta['vocab_size']:
        fail(f"vocab_size={explicit['vocab_size']} is smaller than the dataset's {meta['vocab_size']}; "
             f"raise it or drop it")
    return model_type, args


def same_type(value, default):
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default)
    return isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int))


def init_model(c, meta, ckpt_path):
    """(model, checkpoint or None). The seed is set first, so a fresh model is the same every run."""
    torch.manual_seed(c['seed'])
    model_type, args = requested_model(c, meta)
    init_from = c['init_from']
    try:
        if init_from == 'scratch':
            return build_model(model_type or 'gpt', **args), None
        if init_from == 'resume':
            if not os.path.isfile(ckpt_path):
                fail(f"init_from='resume' but {ckpt_path} does not exist; train from scratch first or fix out_dir")
            checkpoint = read_checkpoint(ckpt_path)
            saved, kept = checkpoint['model_args'], {'dropout'}  # every field must match but dropout, which may change
            if c['vocab_size'] is None and saved['vocab_size'] >= args['vocab_size']:
                kept.add('vocab_size')  # the data fits the model's vocabulary (a GPT-2 start's 50,257 tokens)
            if args.get('block_size') == checkpoint['config'].get('block_size'):
                kept.add('block_size')  # the window the run trains on (a GPT-2 start's, under its 1,024)
            diffs = [f"{k} (checkpoint {saved.get(k, '<absent>')!r}, config {v!r})"
                     for k, v in args.items() if k not in kept and saved.get(k, '<absent>') != v]
            if model_type and model_type != checkpoint['model_type']:
                diffs.insert(0, f"model_type (checkpoint {checkpoint['model_type']!r}, config {model_type!r})")
            if diffs:
                fail(f"{ckpt_path} holds a different model than the config: {'; '.join(diffs)}; "
                     f"resume with the config it was trained with, or pick another out_dir")
            dropout = {} if c['dropout'] is None else {'dropout': c['dropout']}
            return from_checkpoint(checkpoint, **dropout), checkpoint
        if init_from.startswith('gpt2'):
            model = from_pretrained(init_from, dropout=c['dropout'] or 0.0)
            if model.config.vocab_size < meta['vocab_size']:
                fail(f"{init_from} has {model.config.vocab_size} tokens, the dataset {meta['vocab_size']}")
            return model, None
    except (ValueError, TypeError, ImportError) as e:
        fail(e)
    except OSError as e:
        fail(f"could not load pretrained {init_from!r} ({e}); it needs the Hugging Face hub or its cache")
    fail(f"init_from must be 'scratch', 'resume' or a GPT-2 name such as 'gpt2', got {init_from!r}")

# -----------------------------------------------------------------------------
# The schedule, and the command line


def get_lr(it, c):
    """Linear warmup, then cosine decay from learning_rate to min_lr over lr_decay_iters."""
    if not c['decay_lr']:
        return c['learning_rate']
    if it < c['warmup_iters']:
        return c['learning_rate'] * (it + 1) / (c['warmup_iters'] + 1)
    decay_iters = c['lr_decay_iters'] or c['max_iters']
    if it >= decay_iters:
        return c['min_lr']
    ratio = (it - c['warmup_iters']) / max(1, decay_iters - c['warmup_iters'])
    return c['min_lr'] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c['learning_rate'] - c['min_lr'])


def check_gate_noise_ramp(c, model, compiled):
    """The ramp's start, the model's gate_noise (which checkpoints keep); None without a ramp."""
    if c['final_gate_noise'] < 0:
        return None
    if not hasattr(model.config, 'gate_noise'):
        fail(f"final_gate_noise ramps a GRT's gate noise (eps_g); a {model_type_of(model)} has none: leave it out")
    if compiled:
        fail("final_gate_noise changes the gate noise every iteration, which recompiles a compiled model; "
             "add --compile=False")
    return model.config.gate_noise


def get_gate_noise(it, c, start):
    """eps_g's std at iteration it: linear from start to final_gate_noise over lr_decay_iters, then held."""
    return start + (c['final_gate_noise'] - start) * min(it / (c['lr_decay_iters'] or c['max_iters']), 1.0)


def main(argv=None):
    """Train as the command line (or argv) says; return {'iter_num', 'best_val_loss', 'val_loss'}."""
    c = read_settings(DEFAULTS, argv)
    try:
        result = train(c)
    except KeyboardInterrupt:  # the loop itself stops at an iteration boundary and exits
        print("\ninterrupted before training began: nothing saved")
        sys.exit(130)
    if dist.is_initialized():
        dist.barrier()  # no rank tears down gloo's connections while another still uses them
        dist.destroy_process_group()
    return result


if __name__ == '__main__':
    main()
    if dist.is_torchelastic_launched():  # a torchrun worker skips the interpreter's teardown: DDP keeps gloo's
        sys.stdout.flush()  # threads alive past destroy_process_group, and one that frees a tensor during
        sys.stderr.flush()  # that teardown aborts the process (SIGABRT, seen once in 140 two-rank runs)
        os._exit(0)
