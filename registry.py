"""
Every model type by name, for the scripts and tests: MODELS maps a model_type to its (config class,
model class), PRESETS names the paper's layouts. model.py and baselines.py define the models and
know nothing of this file, so there is no import cycle: registry imports both.
"""

from baselines import (MoR, MoRConfig, Huginn, HuginnConfig, NoisyRecurrence, NoisyRecurrentConfig,
                       GRTWithoutReinjection, PlainRecurrence, ReinjectedRecurrence, Rung1Config)
from model import GPT, GRT, GPTConfig, GRTConfig, RecurrentConfig

MODELS = {
    'gpt': (GPTConfig, GPT),
    'grt': (GRTConfig, GRT),
    # the paper's recurrent baselines
    'huginn': (HuginnConfig, Huginn),
    'mor': (MoRConfig, MoR),
    # the ablation ladder: each rung adds one part of GRT (rung 5 is 'grt')
    'rung1': (Rung1Config, PlainRecurrence),  # recurrence alone
    'rung2': (RecurrentConfig, PlainRecurrence),  # + prelude/coda split
    'rung3': (NoisyRecurrentConfig, NoisyRecurrence),  # + state noise
    'rung4': (NoisyRecurrentConfig, ReinjectedRecurrence),  # + prelude re-injection W_proj
    'grt_no_e': (GRTConfig, GRTWithoutReinjection),  # GRT less the re-injection: u = h + eps_x
}


def _grt(prelude, core, recur, coda, n_embd, n_head):
    return dict(model_type='grt', n_prelude=prelude, n_core=core, n_recur=recur, n_coda=coda,
                n_embd=n_embd, n_head=n_head)


PRESETS = {
    # paper scale (vocab 50304, block 1024): the dense GPT-2 and the GRT layouts p + c x R + k
    'gpt2-small': dict(model_type='gpt', n_layer=12, n_embd=768, n_head=12),
    'gpt2-medium': dict(model_type='gpt', n_layer=24, n_embd=1024, n_head=16),
    'gpt2-large': dict(model_type='gpt', n_layer=36, n_embd=1280, n_head=20),
    'grt-small-isoflop': _grt(1, 1, 10, 1, 768, 12),
    'grt-medium-isoflop': _grt(2, 5, 4, 2, 1024, 16),
    'grt-large-isoflop': _grt(1, 5, 6, 5, 1280, 20),
    'grt-small-isoparam': _grt(1, 10, 10, 1, 768, 12),
    'grt-medium-isoparam': _grt(2, 20, 4, 2, 1024, 16),
    'grt-large-isoparam': _grt(3, 30, 6, 3, 1280, 20),
    # small enough for tests and CPU smoke runs
    'tiny-gpt': dict(model_type='gpt', n_layer=4, n_embd=64, n_head=4, block_size=64, vocab_size=256),
    'tiny-grt': dict(_grt(1, 1, 4, 1, 64, 4), block_size=64, vocab_size=256),
}
for _preset in PRESETS.values():
    _preset.setdefault('block_size', 1024)
    _preset.setdefault('vocab_size', 50304)


def preset(name, **overrides):
    """(model_type, config) of a named preset, with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    args = {**PRESETS[name], **overrides}
    model_type = args.pop('model_type')
    return model_type, MODELS[model_type][0](**args)


def foreign_fields(model_type, config_args):
    """'a, b do not apply to model_type ...' for the config_args the type's config does not have,
    else None."""
    foreign = sorted(set(config_args) - set(MODELS[model_type][0].__dataclass_fields__))
    if foreign:
        return f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to model_type {model_type!r}"
    return None


def build_model(model_type, **config_args):
    """A fresh model of a registered type from config fields; a field the type does not have is
    refused with one line."""
    if model_type not in MODELS:
        raise ValueError(f"unknown model_type {model_type!r}; known: {', '.join(MODELS)}")
    config_class, model_class = MODELS[model_type]
    foreign = foreign_fields(model_type, config_args)
    if foreign:
        raise ValueError(f"{foreign}; its fields are {', '.join(config_class.__dataclass_fields__)}")
    return model_class(config_class(**config_args))


def from_checkpoint(checkpoint, **config_overrides):
    """The model a train.py checkpoint holds (its 'model_type', 'model_args' and 'model' entries)."""
    model = build_model(checkpoint['model_type'], **{**checkpoint['model_args'], **config_overrides})
    state = {k.removeprefix('_orig_mod.'): v for k, v in checkpoint['model'].items()}  # compiled models
    model.load_state_dict(state)
    return model


def model_type_of(model):
    """The registered name of a model's class and config (rung1 and rung2 share a class)."""
    return next(name for name, (config_class, model_class) in MODELS.items()
                if type(model) is model_class and type(model.config) is config_class)
