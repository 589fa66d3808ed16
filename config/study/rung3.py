# Ablation ladder rung 3, + state noise: h = Core(h + eps_x), eps_x ~ N(0, 0.1^2) in training,
# r ~ Uniform{1..7} (7 at eval).
# FLOPs a trained token matched to config/shakespeare_char_gpt.py and _grt.py (tests/test_configs.py checks it).
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-rung3'
model_type = 'rung3'
n_prelude, n_core, n_recur, n_coda = 1, 1, 7, 1
