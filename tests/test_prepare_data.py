"""Tests for prepare_data.py: the token file format, tokenizers, and downloads against a local HTTP server."""

import hashlib
import os
import random
import socket
import struct
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import prepare_data
from prepare_data import (DownloadError, download, get_tokenizer, load_meta, main, prepare, read_tokens,
                          token_files, write_tokens)


def generated_text(n_chars=5000, seed=0):
    """Text over a small alphabet with non-ASCII letters, so char ids are not simply ASCII codes."""
    rng = random.Random(seed)
    alphabet = 'abcdefgh ijklmnop\nQRST.,;éßλ'
    return ''.join(rng.choice(alphabet) for _ in range(n_chars))


def leftovers(folder):
    return sorted(p.name for p in Path(folder).rglob('*') if p.is_file())


# -----------------------------------------------------------------------------
# a local HTTP server whose answers a test scripts per path

class Handler(BaseHTTPRequestHandler):
    """routes: path -> list of answers, used in order (the last one repeats):
    ('ok', body), ('short', body) = full Content-Length but half the body then close, ('status', code)."""

    def do_GET(self):
        self.server.hits[self.path] += 1
        plan = self.server.routes.get(self.path, [('status', 404)])
        kind, arg = plan[min(self.server.hits[self.path], len(plan)) - 1]
        if kind == 'status':
            self.send_error(arg)
            return
        self.send_response(200)
        self.send_header('Content-Length', str(len(arg)))
        self.end_headers()
        self.wfile.write(arg if kind == 'ok' else arg[:len(arg) // 2])
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    srv.routes, srv.hits = {}, Counter()
    srv.url = f'http://127.0.0.1:{srv.server_address[1]}'
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def sleeps(monkeypatch):
    """Record retry delays instead of sleeping them."""
    calls = []
    monkeypatch.setattr(prepare_data.time, 'sleep', calls.append)
    return calls


# -----------------------------------------------------------------------------
# the token file format

def test_token_file_layout_and_roundtrip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 65536, size=777)
    path = str(tmp_path / 'x.bin')
    write_tokens(path, tokens)
    raw = Path(path).read_bytes()
    assert len(raw) == 1024 + 2 * 777
    assert struct.unpack('<3i', raw[:12]) == (20240520, 1, 777)
    assert raw[12:1024] == bytes(1012)
    assert struct.unpack('<777H', raw[1024:]) == tuple(int(t) for t in tokens)
    got = read_tokens(path)
    assert got.dtype == np.uint16 and np.array_equal(got, tokens)
    assert leftovers(tmp_path) == ['x.bin']  # the temporary file was renamed away


def test_write_tokens_refuses_ids_beyond_uint16(tmp_path):
    with pytest.raises(ValueError, match='0..65535'):
        write_tokens(str(tmp_path / 'x.bin'), [1, 65536])
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize('damage, message', [
    (lambda b: struct.pack('<i', 12345) + b[4:], 'not a token file'),
    (lambda b: b[:4] + struct.pack('<i', 2) + b[8:], 'version 2, this code reads version 1'),
    (lambda b: b[:-1], 'truncated or corrupt'),
    (lambda b: b + b'\0\0', 'truncated or corrupt'),
    (lambda b: b[:1000], 'shorter than the 1024-byte header'),
])
def test_read_tokens_refuses_corrupt_files(tmp_path, damage, message):
    folder = tmp_path / 'mine'
    folder.mkdir()
    path = folder / 'train.bin'
    write_tokens(str(path), np.arange(100))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as e:
        read_tokens(str(path))
    text = str(e.value)
    assert '\n' not in text and 'prepare_data.py --input FILE --name mine' in text  # the hint names the fix


def test_read_tokens_missing_file_names_the_command(tmp_path):
    with pytest.raises(ValueError, match=r'not found; run `python prepare_data.py shakespeare_char --data_dir'):
        read_tokens(str(tmp_path / 'shakespeare_char' / 'train.bin'))
    with pytest.raises(ValueError, match=r'python prepare_data.py fineweb10B'):
        token_files(str(tmp_path / 'fineweb10B'), 'train')


# -----------------------------------------------------------------------------
# text datasets from a local file

def test_prepare_char_from_text_file(tmp_path):
    text = generated_text()
    src = tmp_path / 'story.txt'
    src.write_text(text, encoding='utf-8')
    main(['--input', str(src), '--data_dir', str(tmp_path / 'data')])  # name defaults to the file's stem
    folder = str(tmp_path / 'data' / 'story')
    meta = load_meta(folder)
    assert meta == {'tokenizer': 'char', 'vocab_size': len(set(text)), 'chars': ''.join(sorted(set(text)))}
    train, val = (read_tokens(f) for split in ('train', 'val') for f in token_files(folder, split))
    assert len(train) == int(0.9 * len(text)) and len(train) + len(val) == len(text)
    expected = [meta['chars'].index(c) for c in text]  # ids = positions in the sorted vocabulary
    assert np.array_equal(np.concatenate([train, val]), expected)
    encode, decode = get_tokenizer(meta)
    assert decode(train.tolist()) + decode(val.tolist()) == text
    assert encode('éßλ') == [meta['chars'].index(c) for c in 'éßλ']
    with pytest.raises(ValueError, match=r"vocabulary: 'Zx'"):
        encode('axZ')


def test_prepare_gpt2_from_text_file(tmp_path, gpt2_bpe):
    text = 'Hello world. ' + generated_text(2000, seed=1)
    src = tmp_path / 'in.txt'
    src.write_text(text, encoding='utf-8')
    prepare('bpe', data_dir=str(tmp_path), input_path=str(src), tokenizer='gpt2')
    meta = load_meta(str(tmp_path / 'bpe'))
    assert meta == {'tokenizer': 'gpt2', 'vocab_size': 50257}
    encode, decode = get_tokenizer(meta)
    assert encode('Hello world') == [15496, 995]  # GPT-2's published ids
    assert encode('<|endoftext|>') == [50256]
    train = read_tokens(str(tmp_path / 'bpe' / 'train.bin'))
    val = read_tokens(str(tmp_path / 'bpe' / 'val.bin'))
    assert train[:3].tolist() == [15496, 995, 13]
    assert len(train) == int(0.9 * (len(train) + len(val)))
    assert decode(train.tolist() + val.tolist()) == text  # byte-level BPE round-trips exactly


def test_bad_inputs_fail_with_one_line(tmp_path):
    bad = tmp_path / 'latin1.txt'
    bad.write_bytes('caf\xe9'.encode('latin-1') * 10)
    empty = tmp_path / 'empty.txt'
    empty.write_text('')
    for argv, message in [
        (['--input', str(bad)], 'is not UTF-8 text'),
        (['--input', str(empty)], 'input text is empty'),
        (['--input', str(bad), '--name', '../up'], 'must be a plain folder name'),
        (['--input', str(tmp_path / 'nope.txt')], 'not found'),
        (['wikitext'], "unknown dataset 'wikitext'"),
        (['fineweb10B', '--shards', '0'], '--shards must be between 1 and 103'),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv + ['--data_dir', str(tmp_path / 'data')])
        assert str(e.value.code).startswith('error: ') and message in str(e.value.code)
        assert '\n' not in str(e.value.code)
    (tmp_path / 'data' / 'broken').mkdir(parents=True)
    (tmp_path / 'data' / 'broken' / 'meta.json').write_text('{"tokenizer": ')
    with pytest.raises(ValueError, match='meta.json is not valid JSON.*--name broken'):
        load_meta(str(tmp_path / 'data' / 'broken'))


# -----------------------------------------------------------------------------
# downloads through a local server

def test_download_with_progress(tmp_path, server, capsys):
    body = generated_text(300_000).encode()
    server.routes['/f.txt'] = [('ok', body)]
    path = str(tmp_path / 'f.txt')
    download(server.url + '/f.txt', path, sha256=hashlib.sha256(body).hexdigest())
    assert Path(path).read_bytes() == body and leftovers(tmp_path) == ['f.txt']
    assert 'f.txt' in capsys.readouterr().err  # tqdm's bar, labelled with the file name


def test_checksum_mismatch_leaves_nothing(tmp_path, server, sleeps):
    server.routes['/input.txt'] = [('ok', generated_text().encode())]  # not Tiny Shakespeare
    with pytest.raises(DownloadError, match='sha256') as e:
        prepare('shakespeare_char', data_dir=str(tmp_path), url=server.url + '/input.txt')
    assert '\n' not in str(e.value) and 'input.txt' in str(e.value)
    assert leftovers(tmp_path) == [] and server.hits['/input.txt'] == 1


def test_interrupted_download_is_retried_then_leaves_nothing(tmp_path, server, sleeps):
    server.routes['/f.txt'] = [('short', generated_text().encode())]
    with pytest.raises(DownloadError, match='after 4 attempts') as e:
        download(server.url + '/f.txt', str(tmp_path / 'f.txt'), retries=3, backoff=0.5)
    assert '\n' not in str(e.value)
    assert server.hits['/f.txt'] == 4 and sleeps == [0.5, 1.0, 2.0]  # exponential backoff
    assert leftovers(tmp_path) == []


def test_transient_failures_are_retried(tmp_path, server, sleeps):
    body = generated_text().encode()
    server.routes['/f.txt'] = [('short', body), ('status', 503), ('ok', body)]
    download(server.url + '/f.txt', str(tmp_path / 'f.txt'), sha256=hashlib.sha256(body).hexdigest(), backoff=0)
    assert server.hits['/f.txt'] == 3 and (tmp_path / 'f.txt').read_bytes() == body
    with pytest.raises(DownloadError, match='HTTP 404'):  # a missing file is not retried
        download(server.url + '/missing', str(tmp_path / 'm.txt'), backoff=0)
    assert server.hits['/missing'] == 1 and leftovers(tmp_path) == ['f.txt']
    with pytest.raises(DownloadError, match='No scheme supplied'):  # a malformed --url is not retried
        download('127.0.0.1/f.txt', str(tmp_path / 'u.txt'), backoff=0)
    assert sleeps == [0, 0] and leftovers(tmp_path) == ['f.txt']


def test_shakespeare_char_downloads_once(tmp_path, server, monkeypatch):
    text = generated_text()
    monkeypatch.setattr(prepare_data, 'SHAKESPEARE_SHA256', hashlib.sha256(text.encode()).hexdigest())
    server.routes['/input.txt'] = [('ok', text.encode())]
    for _ in range(2):
        prepare('shakespeare_char', data_dir=str(tmp_path), url=server.url + '/input.txt')
    assert server.hits['/input.txt'] == 1  # the second run found input.txt in place
    assert leftovers(tmp_path) == ['input.txt', 'meta.json', 'train.bin', 'val.bin']
    assert (tmp_path / 'shakespeare_char' / 'input.txt').read_text(encoding='utf-8') == text


def test_shakespeare_bpe_reuses_the_char_download(tmp_path, server, monkeypatch, gpt2_bpe):
    text = 'First Citizen:\nBefore we proceed any further, hear me speak.\n' * 20
    monkeypatch.setattr(prepare_data, 'SHAKESPEARE_SHA256', hashlib.sha256(text.encode()).hexdigest())
    server.routes['/input.txt'] = [('ok', text.encode())]
    prepare('shakespeare_char', data_dir=str(tmp_path), url=server.url + '/input.txt')
    prepare('shakespeare', data_dir=str(tmp_path), url=server.url + '/input.txt')
    assert server.hits['/input.txt'] == 1  # the GPT-2 version read the text the char version fetched
    ids = np.concatenate([read_tokens(f) for split in ('train', 'val')
                          for f in token_files(str(tmp_path / 'shakespeare'), split)])
    assert ids.tolist() == gpt2_bpe.encode_ordinary(text)
    assert load_meta(str(tmp_path / 'shakespeare'))['tokenizer'] == 'gpt2'


def test_no_network_says_what_to_do(tmp_path, sleeps):
    with socket.socket() as s:  # a port nobody listens on: the connection is refused like an offline fetch
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as e:
        main(['--data_dir', str(tmp_path), '--url', f'http://127.0.0.1:{port}/input.txt'])
    message = str(e.value.code)
    assert message.startswith('error: could not fetch http://127.0.0.1') and '\n' not in message
    assert 'no connection' in message and '--input' in message
    assert str(tmp_path / 'shakespeare_char' / 'input.txt') in message  # where to place the file
    assert sleeps == [1.0, 2.0, 4.0] and leftovers(tmp_path) == []


def shard_bytes(tmp_path, name, tokens):
    write_tokens(str(tmp_path / name), tokens)
    return (tmp_path / name).read_bytes()


def test_fineweb_shards_fetch_and_resume(tmp_path, server, sleeps):
    rng = np.random.default_rng(0)
    names = ['fineweb_val_000000.bin', 'fineweb_train_000001.bin', 'fineweb_train_000002.bin']
    shards = {n: rng.integers(0, 50257, size=1000 + 10 * i) for i, n in enumerate(names)}
    bodies = {n: shard_bytes(tmp_path, n + '.src', t) for n, t in shards.items()}
    data_dir, folder = str(tmp_path / 'data'), tmp_path / 'data' / 'fineweb10B'
    for n in names[:2]:
        server.routes[f'/fw/{n}'] = [('ok', bodies[n])]
    server.routes['/fw/' + names[2]] = [('short', bodies[names[2]])]  # the last shard breaks off

    with pytest.raises(DownloadError, match='rerun the same command to resume'):
        prepare('fineweb10B', data_dir=data_dir, url=server.url + '/fw/', shards=2, backoff=0)
    assert leftovers(folder) == sorted(names[:2])  # finished shards kept, no partial third one

    server.routes['/fw/' + names[2]] = [('ok', bodies[names[2]])]
    prepare('fineweb10B', data_dir=data_dir, url=server.url + '/fw', shards=2, backoff=0)
    assert [server.hits['/fw/' + n] for n in names] == [1, 1, 5]  # only the missing shard was fetched again
    assert token_files(str(folder), 'train') == [str(folder / n) for n in names[1:]]
    assert token_files(str(folder), 'val') == [str(folder / names[0])]
    for n in names:
        assert np.array_equal(read_tokens(str(folder / n)), shards[n])
    assert load_meta(str(folder)) == {'tokenizer': 'gpt2', 'vocab_size': 50257}

    (folder / names[1]).write_bytes(bodies[names[1]][:-2])  # a damaged local shard is fetched again
    prepare('fineweb10B', data_dir=data_dir, url=server.url + '/fw', shards=2, backoff=0)
    assert [server.hits['/fw/' + n] for n in names] == [1, 2, 5]
    assert np.array_equal(read_tokens(str(folder / names[1])), shards[names[1]])


def test_fineweb_refuses_a_served_file_without_the_header(tmp_path, server):
    server.routes['/fineweb_val_000000.bin'] = [('ok', b'<html>not a shard</html>' * 100)]
    with pytest.raises(DownloadError, match='not a valid file.*not a token file'):
        prepare('fineweb10B', data_dir=str(tmp_path), url=server.url, shards=1, backoff=0)
    assert leftovers(tmp_path) == []
