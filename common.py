"""
What the scripts share: one-line errors, device and precision choice, keyed randomness, the CPU's
measured peak for MFU, random training windows, writing and loading checkpoints, and compiling. train.py,
sample.py, bench.py, study.py and analyze.py import these from here, never from each other. The end
holds what train.py's loop calls that is not the loop: its log, progress lines and stop signals.
"""

import functools
import hashlib
import json
import os
import pickle
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from config import ConfigError, parse_config
from registry import from_checkpoint

GPU_PEAK_FLOPS = [('H100 PCIe', 756e12), ('H100', 989e12), ('H200', 989e12), ('GH200', 989e12),
                  ('A100', 312e12), ('L40S', 362e12), ('L4', 121e12), ('A10', 125e12), ('V100', 125e12)]


def fail(message):
    """Stop the script with one line that says what went wrong and what to do."""
    sys.exit(f"error: {message}")


def pyplot(missing="matplotlib is not installed: no plot (pip install matplotlib)"):
    """matplotlib.pyplot drawing to files (the Agg backend), or None after printing `missing` where
    matplotlib is not installed (it is optional)."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print(missing)
        return None
    return plt


def read_settings(defaults, argv=None):
    """A script's settings: its defaults, then the config files and --key=value arguments of argv
    (the command line if None), read by config.parse_config; a bad one stops with one line."""
    try:
        return parse_config(defaults, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        fail(e)


# -----------------------------------------------------------------------------
# Devices, precision, randomness


def pick_device(name, local_rank=0):
    """The device to run on: 'auto' is cuda:local_rank, else mps, else cpu. A named device this machine
    lacks stops with one line (torch's own error is a traceback deep inside the first .to(device))."""
    if name == 'auto':
        if torch.cuda.is_available():
            return f'cuda:{local_rank}'
        return 'mps' if torch.backends.mps.is_available() else 'cpu'
    kind, _, index = name.partition(':')
    if kind not in ('cpu', 'cuda', 'mps') or (index and not (kind == 'cuda' and index.isdigit())):
        fail(f"device must be auto, cpu, cuda, cuda:N or mps, got {name!r}")
    if kind == 'cuda' and not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) was built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        fail(f"device={name!r} but {why}; use --device=cpu (or auto), or install a CUDA build of torch")
    if kind == 'cuda' and index and int(index) >= torch.cuda.device_count():
        fail(f"device={name!r} but this machine has {torch.cuda.device_count()} CUDA GPU(s), "
             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if kind == 'mps' and not torch.backends.mps.is_available():
        fail(f"device='mps' but MPS is not available here (it needs Apple silicon, macOS 12.3+ and a torch "
             f"built with MPS); use --device=cpu (or auto)")
    return name


# -----------------------------------------------------------------------------
# Cores shared with other work: torch's threads, and what the timings and the peak are worth


def cpu_times():
    """A snapshot for others_busy: (wall seconds, busy seconds of all cores from /proc/stat, this
    process's CPU seconds); None where there is no /proc/stat (not Linux)."""
    try:
        with open('/proc/stat') as f:
            ticks = [int(t) for t in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except OSError:
        return None
    return time.monotonic(), (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf('SC_CLK_TCK'), time.process_time()


def others_busy(since):
    """The cores other work kept busy since the cpu_times() snapshot `since`, on average: every core's
    busy time (a VM's stolen time too) less this process's own. None where unknown."""
    now = cpu_times()
    if since is None or now is None or now[0] - since[0] < 0.05:
        return None
    return max(0.0, (now[1] - since[1] - (now[2] - since[2])) / (now[0] - since[0]))


def cpu_threads(busy, cores, threads):
    """torch's threads beside other work keeping `busy` cores of `cores` busy: one per core it leaves
    free, at least 1, at most `threads` (torch's default). A thread sharing a core with other work
    holds back every parallel op's team, since each op waits for its slowest thread
    (docs/training.md#sharing-the-cores)."""
    return max(1, min(threads, round(cores - busy)))


def share_cores(device):
    """At start-up on a CPU, torch's threads by cpu_threads from how many cores other work keeps busy
    over 0.2 s of /proc/stat (the 1-minute load average where there is none); OMP_NUM_THREADS, where
    set, decides instead and this does nothing. Called once: shorter windows during a run misread an
    idle machine (docs/training.md#sharing-the-cores). When other work takes half a core or more it
    prints a line saying so to stderr, and returns it; '' otherwise."""
    if device != 'cpu' or 'OMP_NUM_THREADS' in os.environ:
        return ''
    since = cpu_times()
    time.sleep(0.2)
    busy = others_busy(since)
    if busy is None:
        busy = os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0
    cores = os.cpu_count() or 1
    torch.set_num_threads(cpu_threads(busy, cores, torch.get_num_threads()))
    if busy < 0.5:
        return ''
    note = (f"note: other work keeps {busy:.1f} of {cores} cores busy, so torch runs "
            f"{torch.get_num_threads()} thread(s), one per core it leaves free")
    print(note, file=sys.stderr)
    return note


def resume_threads(device, threads, verbose=True):
    """torch's threads for a run resumed on a CPU: `threads`, the count its checkpoint trained on, whatever
    the load now, so it continues bit-exact (another count splits the sums otherwise: the losses drift).
    Where OMP_NUM_THREADS sets another count, the user's choice stands and a
    line says the run will not repeat the uninterrupted one. A checkpoint without a count: share_cores."""
    if device != 'cpu':
        return
    if threads is None:
        share_cores(device)
        return
    omp = os.environ.get('OMP_NUM_THREADS')
    if omp is not None and omp.strip() != str(threads):
        if verbose:
            print(f"note: OMP_NUM_THREADS={omp} but the checkpoint trained on {threads} thread(s), so the resumed run "
                  f"will not repeat the uninterrupted one bit for bit; OMP_NUM_THREADS={threads} would",
                  file=sys.stderr, flush=True)
        return
    torch.set_num_threads(threads)
    if verbose:
        print(f"resuming on {threads} thread(s), the count the checkpoint trained on, for a bit-exact continuation "
              f"(OMP_NUM_THREADS=N sets another, and the run drifts)", file=sys.stderr, flush=True)


@functools.cache
def cpu_bf16_speedup():
    """How many times faster torch multiplies bf16 matrices than fp32 ones on this CPU (the fastest of 5
    256-wide x @ W^T in each, 10-20 ms, once per process). Measured rather than read from the CPU's
    flags, which do not say which kernel torch runs (docs/training.md#dtype)."""
    return _time_linear(256, torch.float32, 5) / _time_linear(256, torch.bfloat16, 5)


CPU_BF16_MIN_WIDTH = 384  # 'auto' keeps narrower models in fp32 on a CPU: their products are too small for bf16


def pick_dtype(name, device_type, warn=True, n_embd=None):
    """'auto': bf16 on CUDA (fp16 where it has no bf16); on a CPU, bf16 only where its bf16 matrix
    products are the faster (cpu_bf16_speedup) and the model is at least CPU_BF16_MIN_WIDTH wide (n_embd;
    None: any width), else fp32. A forced bf16 where it is slower is allowed but warned about (warn=False:
    silent, for DDP ranks other than the first)."""
    if name == 'auto':
        if device_type == 'cuda':
            return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float16'
        wide = n_embd is None or n_embd >= CPU_BF16_MIN_WIDTH
        return 'bfloat16' if device_type == 'cpu' and wide and cpu_bf16_speedup() > 1 else 'float32'
    if name not in ('float32', 'bfloat16', 'float16'):
        fail(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    if name == 'float16' and device_type != 'cuda':
        fail("dtype=float16 needs CUDA (it trains with a GradScaler); use --dtype=bfloat16 or --dtype=float32")
    if name == 'bfloat16' and device_type == 'cpu' and warn:
        speedup = cpu_bf16_speedup()
        if speedup < 1:
            print(f"warning: bf16 matrix products run {1 / speedup:.1f}x slower than float32 on this CPU, so "
                  "training in bfloat16 is slower too: use --dtype=float32 (or --dtype=auto)",
                  file=sys.stderr, flush=True)
    return name


def autocast_context(device_type, dtype):
    """Mixed precision: autocast to bf16/fp16, nothing for fp32 (train.py, sample.py and bench.py)."""
    if dtype == 'float32':
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def rng_key(*parts):
    """A 63-bit seed from any tuple of values, e.g. (seed, 'data', rank, iteration, micro_step)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), 'little') >> 1


_cpu_peak_cache = {}
_cpu_peak_busy = {}  # dtype -> cores other work kept busy while the kept peak was measured (None: unknown)


def _time_linear(n, dtype, repeats):
    """Seconds of the fastest of `repeats` (n, n) x (n, n)^T products in dtype, after one warm-up."""
    # its own generator: whether a script measures depends on its settings and on what was measured
    # already, so drawing from the global one would shift a seeded run's stream unpredictably
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float('inf')
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu_peak(dtype, budget_s=1.0, max_n=4096, repeats=3, again=False):
    """The CPU's practical peak FLOP/s in dtype (the one the run computes in: bf16 under bf16
    autocast, fp32 otherwise), measured once per dtype and process: the best rate of square
    products laid out as nn.Linear computes them (x @ W^T; an emulated bf16 kernel runs ~10x
    faster in this layout than in a @ b, so timing a @ b gave a peak below the model's own rate and
    MFU above 100%).

    Sizes grow from n = 128, doubling while the next size (8x the work, timed repeats + 1 times)
    is expected to fit in what is left of budget_s, up to max_n. So it takes about budget_s at
    most on any CPU: where bf16 is emulated (1-10 GFLOP/s) it stops at n = 256 or 512, where a
    fixed 2048^3 product in bf16 took 20 s each.

    A measurement taken while other work loads the cores is too low (cpu_peak_contended says so).
    again=True measures anew and keeps the higher figure: train.py does so when a run's own FLOP rate
    exceeds the peak."""
    if again or dtype not in _cpu_peak_cache:
        best, n, spent, since = 0.0, 128, 0.0, cpu_times()
        while True:
            seconds = max(_time_linear(n, dtype, repeats), 1e-9)
            spent += (repeats + 1) * seconds
            best = max(best, 2 * n ** 3 / seconds)
            if 2 * n > max_n or spent + 8 * (repeats + 1) * seconds > budget_s:
                break
            n *= 2
        if best > _cpu_peak_cache.get(dtype, 0.0):
            _cpu_peak_cache[dtype], _cpu_peak_busy[dtype] = best, others_busy(since)
    return _cpu_peak_cache[dtype]


def cpu_peak_contended(dtype):
    """A line saying the measured peak in dtype may read low, when other work kept more cores busy while
    it was measured than torch's threads left free; '' otherwise."""
    busy, cores = _cpu_peak_busy.get(dtype), os.cpu_count() or 1
    if busy is None or busy < cores - torch.get_num_threads() + 0.25:
        return ''
    return (f"note: other work kept {busy:.1f} of {cores} cores busy while the peak was measured on "
            f"{torch.get_num_threads()} thread(s), so it may read low and MFU high; --peak_flops=... sets a fixed peak")


def peak_flops_for(device, ptdtype, override, verbose=False):
    """Per-device peak FLOP/s in the run's dtype, for MFU: override if > 0; on CUDA the datasheet's
    dense 16-bit tensor-core figure (fp32 runs use TF32, which train.py enables: half of it; V100
    has no TF32); on CPU measured by measure_cpu_peak; 0 (MFU not shown) on MPS."""
    if override > 0:
        return override
    if device.startswith('cuda'):
        name = torch.cuda.get_device_name(device)
        key, flops = next(((k, f) for k, f in GPU_PEAK_FLOPS if k in name), (None, 312e12))
        if key is None:
            print(f"note: no datasheet peak for {name}; MFU is against A100's 312 TFLOPS, set --peak_flops=...")
        if ptdtype == torch.float32:
            flops = 15.7e12 if key == 'V100' else flops / 2
        return flops
    if device == 'cpu':
        if verbose and ptdtype not in _cpu_peak_cache:
            print(f"measuring the CPU's peak FLOP/s in {str(ptdtype).removeprefix('torch.')} for MFU ...",
                  end=' ', flush=True)
        peak = measure_cpu_peak(ptdtype)
        if verbose:
            print(f"{peak / 1e9:,.1f} GFLOP/s on {torch.get_num_threads()} thread(s)")
            if cpu_peak_contended(ptdtype):
                print(cpu_peak_contended(ptdtype))
        return peak
    return 0.0  # mps: unknown, MFU not shown


def train_flops_per_token(model, seq_len, num_steps=None):
    """Training FLOPs per token at depth r (R if None; nothing for a dense model): forward and backward
    (twice the forward), less the backward of the r - k steps that truncated backprop (backprop_depth = k)
    runs without gradients. train.py passes an iteration's mean r, which slightly undercounts those
    steps when an iteration's depths differ."""
    c, d = model.config, model.config.n_embd
    flops = 3 * model.flops_per_token(seq_len, num_steps)
    k = getattr(c, 'backprop_depth', None)
    if k:
        r = c.n_recur if num_steps is None else num_steps
        step = c.n_core * (24 * d * d + 4 * seq_len * d) + model.step_flops()
        flops -= 2 * max(r - k, 0) * step
    return flops


def estimate_mfu(model, tokens_per_iter, dt, peak_flops, seq_len, num_steps=None):
    """Model FLOPs utilisation: training FLOPs per second over peak_flops."""
    return train_flops_per_token(model, seq_len, num_steps) * tokens_per_iter / dt / peak_flops


class TrainingMFU:
    """A training run's MFU, called at each log line: estimate_mfu against peak_flops_for's peak in the
    run's dtype. A CPU peak this process measured reads low if other work loaded the cores meanwhile, so
    the first figure above 100% measures it again, up to 3 times, keeping the highest. A figure above
    100% after that means the peak is wrong for this device: one warning, and no MFU for the rest of the run."""

    def __init__(self, device, dtype, peak_flops=0.0, verbose=False):
        self.ptdtype, self.dtype = getattr(torch, dtype), dtype
        self.peak = peak_flops_for(device, self.ptdtype, peak_flops, verbose)  # 0: no MFU
        self.measurable = device == 'cpu' and peak_flops <= 0

    def __call__(self, model, tokens, seconds, seq_len, num_steps=None):
        """The MFU of `tokens` trained in `seconds` at mean depth num_steps, or None."""
        if not self.peak:
            return None
        mfu = estimate_mfu(model, tokens, seconds, self.peak, seq_len, num_steps)
        if mfu > 1 and self.measurable:
            self.measurable = False  # once a run: each measurement holds the loop up to a second
            for _ in range(3):
                self.peak = measure_cpu_peak(self.ptdtype, again=True)
                mfu = estimate_mfu(model, tokens, seconds, self.peak, seq_len, num_steps)
                if mfu <= 1:
                    break
        if mfu > 1:
            tqdm.write(f"warning: MFU would be {100 * mfu:.0f}% against a {self.dtype} peak of {self.peak / 1e9:.1f} "
                       f"GFLOP/s, so that peak is wrong for this device; MFU not reported (set --peak_flops=...)",
                       file=sys.stderr)
            self.peak = 0.0
            return None
        return mfu


# -----------------------------------------------------------------------------
# Data: random windows from memory-mapped token files, drawn by a seeded generator


class Batches:
    """Windows of block_size + 1 tokens at uniformly random positions over all shards (a shard is
    picked in proportion to its windows, then an offset in it), nanoGPT-style from np.memmap.

    shards are prepare_data.read_tokens' memmaps; each batch maps the shards it reads anew and unmaps
    them when done. A memmap kept open for the run keeps every page it has read resident, so the process
    grows towards the files' size (nanoGPT#287; docs/long_runs.md)."""

    def __init__(self, shards, block_size, batch_size, device):
        self.files = [(s.filename, s.offset, s.shape) for s in shards]  # no reference to the memmaps kept
        self.block_size, self.batch_size, self.device = block_size, batch_size, device
        self.windows = torch.tensor([len(s) - block_size for s in shards], dtype=torch.float64)
        if self.windows.max() < 1:
            fail(f"the data holds at most {int(self.windows.max()) + block_size} tokens a file, too few for "
                 f"block_size {block_size}; use a smaller block_size or more data")
        self.windows.clamp_(min=0)

    def get(self, generator):
        ids = torch.multinomial(self.windows, self.batch_size, replacement=True, generator=generator)
        offsets = (torch.rand(self.batch_size, generator=generator, dtype=torch.float64) * self.windows[ids]).long()
        ids = ids.tolist()
        shards = {i: np.memmap(self.files[i][0], np.uint16, 'r', *self.files[i][1:]) for i in set(ids)}
        rows = np.stack([shards[i][o:o + self.block_size + 1] for i, o in zip(ids, offsets.tolist())])
        del shards  # unmapped here: the pages just read leave this process's resident memory
        batch = torch.from_numpy(rows.astype(np.int64))
        if self.device.startswith('cuda'):
            batch = batch.pin_memory().to(self.device, non_blocking=True)  # overlaps with the GPU's work
        else:
            batch = batch.to(self.device)
        return batch[:, :-1], batch[:, 1:]


# -----------------------------------------------------------------------------
# A trained model, for sampling, benchmarking and analysis

GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')


def from_pretrained(name_or_model, dropout=0.0):
    """A model.GPT with GPT-2's weights, from a name ('gpt2', 'gpt2-medium', ...) or a Hugging Face
    GPT2LMHeadModel; transformers is needed only here. GPT-2's tanh GELU keeps OpenAI's logits."""
    hf = name_or_model
    if isinstance(name_or_model, str):
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise ImportError("GPT-2's weights need transformers: pip install transformers") from None
        hf = GPT2LMHeadModel.from_pretrained(name_or_model)
    c = hf.config
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer,
                          n_head=c.n_head, n_embd=c.n_embd, dropout=dropout, gelu_approximate='tanh'))
    sd, sd_hf = model.state_dict(), hf.state_dict()
    # Hugging Face stores these as Conv1D, (in, out): transpose them into our Linears
    transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
    with torch.no_grad():
        for k in sd:
            if k != 'lm_head.weight':  # tied to wte
                sd[k].copy_(sd_hf[k].t() if k.endswith(transposed) else sd_hf[k])
    return model


def save_checkpoint(path, checkpoint):
    """Write to a temporary file, then rename: a crash or Ctrl-C mid-write never leaves a torn file."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_checkpoint(path, alternative=''):
    """torch.load of a train.py checkpoint (our own file: it holds the config too, so not weights_only).
    A truncated or corrupt file stops with one line, not torch's traceback; alternative is appended
    to it (e.g. the other checkpoint to try)."""
    try:
        return torch.load(path, map_location='cpu', weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        reason = str(e).splitlines()[0].split('. ')[0] if str(e) else type(e).__name__  # miniz's own advice cut
        fail(f"{path} is truncated or corrupt ({reason}): copy it again or train again{alternative}")


def load_checkpoint(out_dir, ckpt):
    """The checkpoint dict of out_dir/ckpt ('best.pt': best val loss; 'ckpt.pt': the latest, for resume)."""
    path = os.path.join(out_dir, ckpt)
    other = 'ckpt.pt' if ckpt == 'best.pt' else 'best.pt'
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(out_dir, other)):
            fail(f"no checkpoint at {path}, but {other} is there: pick it with --ckpt={other}")
        fail(f"no checkpoint at {path} (nor {other}); train one with `python train.py ... --out_dir={out_dir}`")
    return read_checkpoint(path, f", or use --ckpt={other}" if os.path.isfile(os.path.join(out_dir, other)) else '')


def load_model(init_from, out_dir, device, ckpt='best.pt'):
    """(model in eval mode on device, checkpoint or None) for a train.py checkpoint (init_from='resume')
    or a pretrained GPT-2 (init_from='gpt2', ...)."""
    if init_from in GPT2_NAMES:
        try:
            model = from_pretrained(init_from)
        except OSError as e:
            fail(f"could not load {init_from} from Hugging Face ({str(e).splitlines()[0]}); it needs "
                 f"internet access once, or a local copy in the Hugging Face cache")
        checkpoint = None
    elif init_from == 'resume':
        checkpoint = load_checkpoint(out_dir, ckpt)
        try:
            model = from_checkpoint(checkpoint)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            fail(f"{os.path.join(out_dir, ckpt)} does not hold a model this model.py can build "
                 f"({str(e).splitlines()[0]}); was it written by train.py?")
    else:
        fail(f"init_from must be 'resume' or one of {', '.join(GPT2_NAMES)}, got {init_from!r}")
    model.eval()
    return model.to(device), checkpoint


# -----------------------------------------------------------------------------
# Compile by regions, and whether to


def compile_regions(model, **compile_kwargs):
    """torch.compile each Block once, and a recurrent model's step (its ops around the core), instead of
    the whole model: the Python depth loop stays outside compiled code, so a new r never recompiles.
    A one-block core compiles into the step's graph; a longer core keeps its blocks' own graphs, so
    compile time does not grow with n_core. The noise stays eager (torch's own generator, seeded by
    train.py). docs/training.md#compile."""
    from model import Block, RecurrentLM
    for block in model.modules():
        if isinstance(block, Block):
            block.compile(**compile_kwargs)
    if isinstance(model, RecurrentLM) and hasattr(model, 'recurrence_step'):  # MoR routes: blocks only
        if model.config.n_core > 1:
            model.run_core = torch.compiler.disable(model.run_core, recursive=False)
        model.noise = torch.compiler.disable(model.noise)
        model.recurrence_step = torch.compile(model.recurrence_step, **compile_kwargs)
    return model


def resolve_compile(setting, device_type, n_embd):
    """(compile or not, why 'auto' chose off, else None). 'auto' (or None) compiles only on CUDA at
    n_embd >= 256: on a CPU, and for narrow models, compiling costs more than it saves."""
    if setting is True or setting is False:
        return setting, None
    if setting not in (None, 'auto'):
        fail(f"compile must be True, False or 'auto', got {setting!r}")
    where = f"on {device_type}" if device_type != 'cuda' else f"at n_embd={n_embd} (< 256)" if n_embd < 256 else None
    if where:
        return False, f"compile='auto': off {where}, where compiling costs more than it saves; --compile=True forces it"
    return True, None


# -----------------------------------------------------------------------------
# train.py's run: its log, its progress lines where stderr is a file, its stop signals


def open_log(c, iter_num):
    """out_dir/log.jsonl: a fresh run starts it; a resumed one keeps the lines up to its iteration
    (not one torn by a hard kill) and appends, writing the rest again."""
    os.makedirs(c['out_dir'], exist_ok=True)
    path = os.path.join(c['out_dir'], 'log.jsonl')
    if c['init_from'] == 'resume' and os.path.isfile(path):
        truncate_log(path, iter_num)
    return open(path, 'a' if c['init_from'] == 'resume' else 'w')


def truncate_log(path, iter_num):
    with open(path) as f:
        lines = [line for line in f if line.endswith('}\n') and json.loads(line)['iter'] <= iter_num]
    with open(path + '.tmp', 'w') as f:
        f.writelines(lines)
    os.replace(path + '.tmp', path)


class BarLines:
    """tqdm's file where stderr is not a terminal: each redraw one line (tqdm starts a redraw with '\\r',
    which in a file runs every update into one line)."""

    def __init__(self, file):
        self.file = file

    def write(self, text):
        text = text.strip('\r\n').rstrip()
        if text:
            self.file.write(text + '\n')

    def flush(self):
        self.file.flush()


@contextmanager
def stop_signals_between_iterations(ddp, device):
    """Ctrl-C (SIGINT) and SIGTERM (torchrun's way to stop its workers, a cluster's before preempting)
    only set a flag, and the loop asks the yielded stop_requested() at each iteration boundary, so
    ckpt.pt and log.jsonl agree on the iteration. Under DDP the ranks agree (one small all-reduce an
    iteration): none waits in a collective the others have left. Signals handled elsewhere are left alone."""
    interrupted, installed = threading.Event(), {}
    if threading.current_thread() is threading.main_thread():
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) is default:
                installed[sig] = signal.signal(sig, lambda signum, frame: interrupted.set())

    def stop_requested():
        if not ddp:
            return interrupted.is_set()
        flag = torch.tensor(float(interrupted.is_set()), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0
    try:
        yield stop_requested
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)
