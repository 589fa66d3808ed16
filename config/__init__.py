"""
The one configuration parser, shared by train.py, sample.py and bench.py.

A script declares its settings as a dict of defaults. The command line is then read in nanoGPT's
style: `script.py [config/file.py ...] [--key=value ...]`, applied left to right. A config file is
plain Python assignments (`learning_rate = 6e-4`); a `--key=value` is read as a Python literal
(`--compile=False`, `--lr=1e-3`) and otherwise as a string (`--dataset=shakespeare_char`).
Every key must be one the script declares, and every value must have its default's type
(an int is accepted where a float is expected; a None default accepts anything).
"""

import ast
import difflib
import os


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line that says what to do."""


def _check(defaults, key, value, origin):
    if key not in defaults:
        close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"valid keys: {', '.join(sorted(defaults))}"
        raise ConfigError(f"unknown config key {key!r} ({origin}); {hint}")
    default = defaults[key]
    if default is None or value is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        if type(value) is not type(default):
            raise ConfigError(f"config key {key!r} ({origin}) must be {type(default).__name__}, "
                              f"got {value!r}; write e.g. --{key}={default!r}")
        return value
    if isinstance(default, float) and isinstance(value, int):
        return float(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    if not isinstance(value, type(default)):
        raise ConfigError(f"config key {key!r} ({origin}) must be {type(default).__name__}, "
                          f"got {type(value).__name__} {value!r}; write e.g. --{key}={default!r}")
    return value


def _read_file(path):
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found; pass an existing file such as config/grt_small.py")
    values = {}
    with open(path) as f:
        source = f.read()
    try:
        exec(compile(source, path, 'exec'), {}, values)
    except Exception as e:
        raise ConfigError(f"config file {path!r} failed to run: {type(e).__name__}: {e}") from None
    return {k: v for k, v in values.items() if not k.startswith('_') and not callable(v)
            and type(v).__name__ != 'module'}


def _parse_value(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string


def parse_config(defaults, argv):
    """Return a new dict: defaults updated by the config files and --key=value arguments in argv."""
    config = dict(defaults)
    for arg in argv:
        if arg.startswith('--'):
            key, sep, text = arg[2:].partition('=')
            if not sep:
                raise ConfigError(f"argument {arg!r} has no value; write --{key}=VALUE")
            value = text if isinstance(defaults.get(key), str) else _parse_value(text)  # --name=123 stays a str
            config[key] = _check(defaults, key, value, origin=arg)
        else:
            for key, value in _read_file(arg).items():
                config[key] = _check(defaults, key, value, origin=f"in {arg}")
    return config
