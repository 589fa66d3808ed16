"""
Sample from a trained model, streaming the text as it is generated.

    python sample.py --out_dir=out-shakespeare-char-grt
    python sample.py --out_dir=out-shakespeare-char-grt --start="ROMEO:" --num_steps=16 --kv_mode=mean
    python sample.py --init_from=gpt2 --start=FILE:prompt.txt      # OpenAI's GPT-2 (needs transformers)

Settings are read by the same parser as train.py (config files and --key=value). The checkpoint
carries its tokenizer (meta.json's char vocabulary or the GPT-2 BPE), so no data directory is needed.
"""

import os
import sys

import torch

import prepare_data
from config import ConfigError, parse_config
from model import GPT, GRT, from_checkpoint
from train import autocast_context, pick_device, pick_dtype

DEFAULTS = dict(
    init_from='resume',  # 'resume' (out_dir/ckpt.pt, written by train.py) or 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'
    out_dir='out',
    start='\n',  # the prompt, or 'FILE:path' to read it from a file
    num_samples=3,
    max_new_tokens=500,
    temperature=0.8,  # 1.0 = the model's distribution, lower = more conservative, 0 = greedy
    top_k=200,  # keep only the top_k most likely tokens; None keeps all
    seed=1337,
    num_steps=None,  # GRT: recurrence steps R at generation; None = the R it was trained with
    kv_mode='per_step',  # GRT core KV cache: 'per_step' (exact), 'shared' or 'mean' (see model.GRT.new_kv_cache)
    device='auto',  # 'auto' (cuda > mps > cpu), 'cpu', 'cuda', ...
    dtype='auto',  # 'auto', 'float32', 'bfloat16' or 'float16', as in train.py
)
GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')


def fail(message):
    sys.exit(f"error: {message}")


def load_model(init_from, out_dir, device):
    """(model in eval mode on device, meta) for a train.py checkpoint or a pretrained GPT-2."""
    if init_from in GPT2_NAMES:
        try:
            model = GPT.from_pretrained(init_from)
        except OSError as e:
            fail(f"could not load {init_from} from Hugging Face ({str(e).splitlines()[0]}); it needs "
                 f"internet access once, or a local copy in the Hugging Face cache")
        meta = {'tokenizer': 'gpt2', 'vocab_size': model.config.vocab_size}
    elif init_from == 'resume':
        path = os.path.join(out_dir, 'ckpt.pt')
        if not os.path.isfile(path):
            fail(f"no checkpoint at {path}; train one with `python train.py ... --out_dir={out_dir}`, "
                 f"point --out_dir at a directory holding ckpt.pt, or use --init_from=gpt2")
        checkpoint = torch.load(path, map_location='cpu', weights_only=False)
        try:
            model = from_checkpoint(checkpoint)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            fail(f"{path} does not hold a model this model.py can build ({str(e).splitlines()[0]}); "
                 f"was it written by train.py?")
        meta = checkpoint.get('meta') or {'tokenizer': 'gpt2'}
    else:
        fail(f"init_from must be 'resume' or one of {', '.join(GPT2_NAMES)}, got {init_from!r}")
    model.eval()
    return model.to(device), meta


def read_prompt(start):
    if start.startswith('FILE:'):
        path = start[len('FILE:'):]
        if not os.path.isfile(path):
            fail(f"prompt file {path} not found; pass --start=FILE:<existing file> or the text itself")
        with open(path, encoding='utf-8') as f:
            return f.read()
    return start


def check_generation_args(model, c):
    """The sampling settings this model accepts, each refused with a one-line fix."""
    if c['kv_mode'] not in model.kv_modes:
        fail(f"kv_mode {c['kv_mode']!r} is not available for this {type(model).__name__}; "
             f"choose one of {', '.join(model.kv_modes)}")
    if not isinstance(model, GRT) and c['num_steps'] is not None:
        fail("num_steps applies to a recurrent (GRT) model; this checkpoint is dense, leave it unset")
    if c['num_steps'] is not None and (not isinstance(c['num_steps'], int) or c['num_steps'] < 1):
        fail(f"num_steps must be an integer >= 1 (the model was trained with R = {model.config.n_recur}), "
             f"got {c['num_steps']!r}")
    if c['temperature'] < 0:
        fail(f"temperature must be >= 0 (0 = greedy), got {c['temperature']}")
    if c['top_k'] is not None and (not isinstance(c['top_k'], int) or c['top_k'] < 1):
        fail(f"top_k must be an integer >= 1 or None, got {c['top_k']!r}")


class StreamDecoder:
    """Turns token ids into text pieces as they arrive. A GPT-2 BPE token can end inside a UTF-8
    character, which decodes to U+FFFD until the next token completes it, so a piece ending in
    U+FFFD is held back until then."""

    def __init__(self, decode):
        self.decode, self.ids, self.emitted = decode, [], 0

    def add(self, token_id):
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if text.endswith('\ufffd'):
            return ''
        piece, self.emitted = text[self.emitted:], len(text)
        return piece

    def flush(self):
        text = self.decode(self.ids)
        piece, self.emitted = text[self.emitted:], len(text)
        return piece


def main(argv=None):
    try:
        c = parse_config(DEFAULTS, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        fail(str(e))
    device = pick_device(c['device'], 0)
    device_type = 'cuda' if device.startswith('cuda') else device
    dtype = pick_dtype(c['dtype'], device_type)
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    model, meta = load_model(c['init_from'], c['out_dir'], device)
    check_generation_args(model, c)
    encode, decode = prepare_data.get_tokenizer(meta)
    try:
        start_ids = encode(read_prompt(c['start']))
    except ValueError as e:  # a char vocabulary lacks some of the prompt's characters
        fail(f"{e}; change --start")
    if not start_ids:
        fail("the prompt is empty; pass --start with at least one character")
    block_size = model.config.block_size
    if len(start_ids) > block_size:
        print(f"warning: the prompt has {len(start_ids)} tokens, more than block_size {block_size}; "
              f"keeping its last {block_size}", file=sys.stderr)
        start_ids = start_ids[-block_size:]
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]

    torch.manual_seed(c['seed'])  # here, after building the model (its init draws from the same generator)

    with autocast_context(device_type, dtype):
        for _ in range(c['num_samples']):
            print(decode(start_ids), end='', flush=True)
            stream = StreamDecoder(decode)
            tokens = model.generate_tokens(x, c['max_new_tokens'], temperature=c['temperature'],
                                           top_k=c['top_k'], num_steps=c['num_steps'], kv_mode=c['kv_mode'])
            for token in tokens:
                print(stream.add(token.item()), end='', flush=True)
            print(stream.flush())
            print('---------------')


if __name__ == '__main__':
    main()
