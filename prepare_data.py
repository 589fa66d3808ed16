"""
Prepare a dataset for train.py: fetch or read the text, tokenize it, write token files.

    python prepare_data.py                          # shakespeare_char: Tiny Shakespeare, characters
    python prepare_data.py shakespeare              # the same text in the GPT-2 BPE
    python prepare_data.py fineweb10B --shards 9    # pre-tokenized GPT-2 FineWeb shards, 100M tokens each
    python prepare_data.py --input my.txt --name mine --tokenizer=gpt2

Everything lands in data/<name>/: train.bin and val.bin (fineweb10B keeps its shard names,
fineweb_train_00000N.bin and fineweb_val_000000.bin) and meta.json (tokenizer, vocab_size and, for
characters, the vocabulary in id order). Every token file has the FineWeb shards' layout: a 1024-byte
header of 256 int32 (magic, version, token count, zeros) and then the tokens as uint16. read_tokens()
is the one reader in the project; train.py, sample.py and bench.py load data only through this module.

Downloads go to a `.part` file, are checked (sha256, or header and length for shards) and only then
renamed, so an interrupted or corrupt download never leaves a file that looks complete.
"""

import argparse
import glob
import hashlib
import json
import os
import sys
import time

import numpy as np
import requests
from tqdm import tqdm

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256  # the header of the kjj0/fineweb10B-gpt2 shards
HEADER_BYTES = HEADER_INTS * 4

SHAKESPEARE_URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
SHAKESPEARE_SHA256 = '86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed'
FINEWEB_URL = 'https://huggingface.co/datasets/kjj0/fineweb10B-gpt2/resolve/main'  # + '/<shard file>'
FINEWEB_MAX_SHARDS = 103  # fineweb_train_000001.bin .. fineweb_train_000103.bin
GPT2_VOCAB_SIZE = 50257
DATASETS = ('shakespeare_char', 'shakespeare', 'fineweb10B')


class DownloadError(ValueError):
    """A file could not be fetched or failed its check; the message is one line that says what to do.
    A ValueError like every other bad-input error here, so callers need to catch only one kind."""


# -----------------------------------------------------------------------------
# token files: the one format and the one reader

def prepare_command(data_dir):
    """The command that (re)creates data_dir, for error messages."""
    root, name = os.path.split(os.path.normpath(data_dir))
    where = '' if os.path.normpath(root) == 'data' else f' --data_dir {root or "."}'
    if name in DATASETS:
        return f'python prepare_data.py {name}{where}'
    return f'python prepare_data.py --input FILE --name {name}{where}'


def write_tokens(path, tokens):
    """Write tokens (ints in 0..65535) to path with the 1024-byte header, atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError(f'write_tokens({path!r}) needs a non-empty 1-D sequence of token ids')
    if tokens.min() < 0 or tokens.max() > 65535:
        raise ValueError(f'token ids for {path!r} must lie in 0..65535 to fit uint16 '
                         f'(got {tokens.min()}..{tokens.max()}); use a smaller vocabulary')
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = MAGIC, VERSION, len(tokens)
    tmp = f'{path}.{os.getpid()}.part'  # per process: torchrun ranks preparing at once do not collide
    try:
        with open(tmp, 'wb') as f:
            f.write(header.tobytes())
            f.write(tokens.astype(np.uint16).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the whole new one, never half of it
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _token_count(path):
    """The token count of a token file whose header and length check out; else ValueError naming the fault."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f'{path} is truncated ({size} bytes, shorter than the {HEADER_BYTES}-byte header)')
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    magic, version, count = (int(x) for x in header[:3])
    if magic != MAGIC:
        raise ValueError(f'{path} is not a token file (magic {magic}, expected {MAGIC})')
    if version != VERSION:
        raise ValueError(f'{path} has token file version {version}, this code reads version {VERSION}')
    if count <= 0 or size != HEADER_BYTES + 2 * count:
        raise ValueError(f'{path} is {size} bytes but its header promises {count} tokens '
                         f'({HEADER_BYTES + 2 * count} bytes): truncated or corrupt')
    return count


def read_tokens(path):
    """Return the tokens of a token file as a read-only np.memmap of uint16, after checking its header."""
    command = prepare_command(os.path.dirname(path) or '.')
    if not os.path.isfile(path):
        raise ValueError(f'token file {path} not found; run `{command}`')
    try:
        count = _token_count(path)
    except ValueError as e:
        raise ValueError(f'{e}; delete it and run `{command}`') from None
    return np.memmap(path, dtype=np.uint16, mode='r', offset=HEADER_BYTES, shape=(count,))


def token_files(data_dir, split):
    """The token files of one split ('train' or 'val'): [train.bin], or the sorted FineWeb shards."""
    assert split in ('train', 'val'), split
    single = os.path.join(data_dir, f'{split}.bin')
    files = [single] if os.path.isfile(single) else sorted(glob.glob(os.path.join(data_dir, f'fineweb_{split}_*.bin')))
    if not files:
        raise ValueError(f'no {split} token files in {data_dir}; run `{prepare_command(data_dir)}`')
    return files


def load_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise ValueError(f'{path} not found; run `{prepare_command(data_dir)}`')
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f'{path} is not valid JSON ({e}); delete it and run `{prepare_command(data_dir)}`') from None


def _write_meta(data_dir, meta):
    tmp = os.path.join(data_dir, f'meta.json.{os.getpid()}.part')
    with open(tmp, 'w', encoding='utf-8') as f:
        json.dump(meta, f, ensure_ascii=False)
    os.replace(tmp, os.path.join(data_dir, 'meta.json'))


# -----------------------------------------------------------------------------
# tokenizers

def _gpt2_encoding():
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2')
    except OSError as e:  # requests' errors are OSErrors: no network and no cache
        raise ValueError(f'could not load the GPT-2 BPE ({type(e).__name__}): tiktoken downloads it on first use '
                         f'and caches it, so run this once online, or set TIKTOKEN_CACHE_DIR to a folder holding '
                         f"tiktoken's cache of it (filled online by tiktoken.get_encoding('gpt2'))") from None


def get_tokenizer(meta):
    """(encode, decode) for a dataset's meta.json: encode str -> list[int], decode list[int] -> str."""
    if meta.get('tokenizer') == 'gpt2':
        enc = _gpt2_encoding()
        return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode
    if meta.get('tokenizer') != 'char':
        raise ValueError(f"unknown tokenizer {meta.get('tokenizer')!r} in meta.json; expected 'char' or 'gpt2'")
    chars = meta['chars']
    stoi = {c: i for i, c in enumerate(chars)}

    def encode(s):
        missing = sorted(set(s) - stoi.keys())
        if missing:
            raise ValueError(f'characters not in this dataset\'s vocabulary: {"".join(missing)!r}; '
                             f'use only characters of its training text')
        return [stoi[c] for c in s]

    return encode, lambda ids: ''.join(chars[i] for i in ids)


def tokenize(text, tokenizer):
    """Token ids of text (np.uint16) and the meta.json that decodes them."""
    if tokenizer == 'char':
        chars = ''.join(sorted(set(text)))
        if len(chars) > 65536:
            raise ValueError(f'{len(chars)} distinct characters do not fit uint16 tokens; use --tokenizer=gpt2')
        lookup = np.zeros(max(map(ord, chars)) + 1, dtype=np.uint16)  # code point -> id, vectorised below
        lookup[[ord(c) for c in chars]] = np.arange(len(chars))
        ids = lookup[np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)]
        return ids, {'tokenizer': 'char', 'vocab_size': len(chars), 'chars': chars}
    if tokenizer == 'gpt2':
        ids = np.array(_gpt2_encoding().encode_ordinary(text), dtype=np.uint16)
        return ids, {'tokenizer': 'gpt2', 'vocab_size': GPT2_VOCAB_SIZE}
    raise ValueError(f"unknown tokenizer {tokenizer!r}; use --tokenizer=char or --tokenizer=gpt2")


# -----------------------------------------------------------------------------
# downloads

class _Incomplete(Exception):
    pass


def _fetch(url, part, label):
    """One attempt: stream url into part with a progress bar; raise if the body comes up short."""
    # identity encoding: Content-Length then counts the bytes we write, so a short body is detectable
    with requests.get(url, stream=True, timeout=(10, 60), headers={'Accept-Encoding': 'identity'}) as r:
        r.raise_for_status()
        total = int(r.headers.get('Content-Length', 0))
        done = 0
        with open(part, 'wb') as f, tqdm(total=total or None, unit='B', unit_scale=True, unit_divisor=1024,
                                         desc=label) as bar:
            for chunk in r.iter_content(chunk_size=1 << 20):
                f.write(chunk)
                done += len(chunk)
                bar.update(len(chunk))
        if total and done != total:
            raise _Incomplete(f'connection closed after {done} of {total} bytes')


def _reason(e):
    if isinstance(e, requests.HTTPError):
        return f'HTTP {e.response.status_code}'
    if isinstance(e, requests.ConnectionError):
        return 'no connection'
    if isinstance(e, requests.Timeout):
        return 'timed out'
    if isinstance(e, requests.exceptions.ChunkedEncodingError):
        return 'connection closed mid-transfer'
    return str(e) or type(e).__name__


def download(url, path, sha256=None, check=None, retries=3, backoff=1.0):
    """Fetch url to path through a .part file beside it, retrying failed transfers after backoff * 2^k seconds.
    The file is renamed into place only when complete and verified: its sha256 must equal sha256 (if
    given) and check(part_path) (if given) must not raise. On any failure nothing is left behind."""
    part = f'{path}.{os.getpid()}.part'  # per process: torchrun ranks fetching at once do not collide
    try:
        for attempt in range(retries + 1):
            try:
                _fetch(url, part, label=os.path.basename(path))
                break
            except (requests.RequestException, _Incomplete) as e:
                status = e.response.status_code if isinstance(e, requests.HTTPError) else None
                # a 404 or a malformed URL (requests' URL errors are ValueErrors) will not heal by waiting
                permanent = isinstance(e, ValueError) or (status is not None and status < 500 and status != 429)
                if permanent or attempt == retries:
                    tries = f' after {attempt + 1} attempts' if attempt else ''
                    raise DownloadError(f'could not fetch {url}{tries} ({_reason(e)})') from None
                delay = backoff * 2 ** attempt
                print(f'fetching {url} failed ({_reason(e)}); retry {attempt + 1}/{retries} in {delay:g}s',
                      file=sys.stderr)
                time.sleep(delay)
        if sha256 is not None:
            got = _sha256(part)
            if got != sha256:
                raise DownloadError(f'{url} has sha256 {got}, expected {sha256}: wrong or corrupt file')
        if check is not None:
            try:
                check(part)
            except ValueError as e:
                raise DownloadError(f'{url} is not a valid file: {e}') from None  # e names the .part file
        os.replace(part, path)
    finally:  # also on Ctrl-C: never leave a half-written file
        if os.path.exists(part):
            os.remove(part)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()


# -----------------------------------------------------------------------------
# the datasets

def _shakespeare_text(data_dir, name, url, retries, backoff):
    """Tiny Shakespeare from data/<name>/input.txt, the other Shakespeare dataset's copy, or the network."""
    path = os.path.join(data_dir, name, 'input.txt')
    sibling = os.path.join(data_dir, 'shakespeare' if name == 'shakespeare_char' else 'shakespeare_char', 'input.txt')
    if not os.path.isfile(path) and os.path.isfile(sibling) and _sha256(sibling) == SHAKESPEARE_SHA256:
        path = sibling  # the same text: no need to fetch it twice
    source = path if os.path.isfile(path) else f'{url or SHAKESPEARE_URL} (downloading)'
    print(f'preparing {os.path.join(data_dir, name)} from {source}')
    if not os.path.isfile(path):
        try:
            download(url or SHAKESPEARE_URL, path, sha256=SHAKESPEARE_SHA256, retries=retries, backoff=backoff)
        except DownloadError as e:
            raise DownloadError(f'{e}; place Tiny Shakespeare at {path}, or pass --url MIRROR, or use '
                                f'--input FILE --name {name}') from None
    return _read_text(path)


def _read_text(path):
    if not os.path.isfile(path):
        raise ValueError(f'input file {path} not found; pass an existing UTF-8 text file to --input')
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f'{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8') from None


def _prepare_text(text, out_dir, tokenizer):
    """Tokenize text, split 90/10 into train.bin/val.bin, write meta.json."""
    if not text:
        raise ValueError('the input text is empty; pass a file with some text')
    ids, meta = tokenize(text, tokenizer)
    n = int(0.9 * len(ids))  # split the token stream: the same cut for characters and BPE
    if n == 0 or n == len(ids):
        raise ValueError(f'text of {len(ids)} tokens is too short to split 90/10 into train and val; use more text')
    write_tokens(os.path.join(out_dir, 'train.bin'), ids[:n])
    write_tokens(os.path.join(out_dir, 'val.bin'), ids[n:])
    _write_meta(out_dir, meta)
    print(f'{out_dir}: {tokenizer} tokenizer, vocab {meta["vocab_size"]}, '
          f'train {n:,} tokens, val {len(ids) - n:,} tokens')


def _prepare_fineweb(out_dir, url, shards, retries, backoff):
    """Fetch the val shard and train shards 1..shards; a shard already complete is kept."""
    if not 1 <= shards <= FINEWEB_MAX_SHARDS:
        raise ValueError(f'--shards must be between 1 and {FINEWEB_MAX_SHARDS}, got {shards}')
    names = ['fineweb_val_000000.bin'] + [f'fineweb_train_{i:06d}.bin' for i in range(1, shards + 1)]
    base = (url or FINEWEB_URL).rstrip('/')
    for name in names:
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            try:
                _token_count(path)
                print(f'{path} is complete, keeping it')
                continue
            except ValueError as e:
                print(f'fetching again: {e}', file=sys.stderr)
        try:
            download(f'{base}/{name}', path, check=_token_count, retries=retries, backoff=backoff)
        except DownloadError as e:
            raise DownloadError(f'{e}; rerun the same command to resume (finished shards are kept), pass '
                                f'--url MIRROR, or place the shard files in {out_dir}') from None
    _write_meta(out_dir, {'tokenizer': 'gpt2', 'vocab_size': GPT2_VOCAB_SIZE})
    print(f'{out_dir}: {shards} train shards and the val shard are complete')


def prepare(dataset, data_dir='data', url=None, input_path=None, tokenizer=None, shards=9, retries=3, backoff=1.0):
    """Write data_dir/<dataset>/ for train.py. With input_path, tokenize that text (tokenizer 'char' by
    default, 'gpt2' for the name 'shakespeare'). Raises ValueError (DownloadError for fetch failures)
    with a one-line message saying what to do."""
    if input_path is not None and dataset == 'fineweb10B':
        raise ValueError('fineweb10B comes pre-tokenized; --input takes a text file for another --name')
    if input_path is not None and url is not None:
        raise ValueError('pass either --input FILE or --url URL, not both')
    if not dataset or os.path.basename(dataset) != dataset or dataset in ('.', '..'):
        raise ValueError(f'dataset name {dataset!r} must be a plain folder name such as mytext')
    if input_path is None and dataset not in DATASETS:
        raise ValueError(f'unknown dataset {dataset!r}; choose one of {", ".join(DATASETS)}, '
                         f'or pass --input FILE --name {dataset}')
    out_dir = os.path.join(data_dir, dataset)
    os.makedirs(out_dir, exist_ok=True)
    if dataset == 'fineweb10B':
        return _prepare_fineweb(out_dir, url, shards, retries, backoff)
    tokenizer = tokenizer or ('gpt2' if dataset == 'shakespeare' else 'char')
    if input_path is not None:
        text = _read_text(input_path)
    else:
        text = _shakespeare_text(data_dir, dataset, url, retries, backoff)
    _prepare_text(text, out_dir, tokenizer)


def main(argv=None):
    parser = argparse.ArgumentParser(description='Prepare a dataset for train.py (see the module docstring).')
    parser.add_argument('dataset', nargs='?', help=f'one of {", ".join(DATASETS)} (default shakespeare_char)')
    parser.add_argument('--input', help='a UTF-8 text file to tokenize instead of a download')
    parser.add_argument('--name', help='output folder name under --data_dir for --input (default: dataset, '
                                       'else the input file name)')
    parser.add_argument('--tokenizer', choices=('char', 'gpt2'), help='for text datasets (default char; '
                                                                      'gpt2 for shakespeare)')
    parser.add_argument('--url', help='a mirror: the text file URL, or for fineweb10B the folder of the shards')
    parser.add_argument('--shards', type=int, default=9, help='fineweb10B train shards, 100M tokens each')
    parser.add_argument('--data_dir', default='data')
    args = parser.parse_args(argv)
    default_name = os.path.splitext(os.path.basename(args.input))[0] if args.input else 'shakespeare_char'
    name = args.name or args.dataset or default_name
    if args.name and args.dataset and args.name != args.dataset:
        sys.exit(f'error: dataset {args.dataset!r} and --name {args.name!r} disagree; give one of them')
    try:
        prepare(name, data_dir=args.data_dir, url=args.url, input_path=args.input, tokenizer=args.tokenizer,
                shards=args.shards)
    except ValueError as e:
        sys.exit(f'error: {e}')
    except KeyboardInterrupt:
        sys.exit('interrupted; no partial file was kept, run the same command again')


if __name__ == '__main__':
    main()
