# Ablation ladder rung 2, + prelude/coda split: h0 = e = Prelude(embeddings), h = Core(h) repeated
# r ~ Uniform{1..7} times in training (7 at eval), then the coda.
# FLOPs a trained token matched to config/shakespeare_char_gpt.py and _grt.py (tests/test_configs.py checks it).
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-rung2'
model_type = 'rung2'
n_prelude, n_core, n_recur, n_coda = 1, 1, 7, 1
