# Ablation ladder rung 1, recurrence alone: no prelude or coda, h = Core(h) from h0 = wte(x) + wpe,
# r ~ Uniform{1..11} in training (11 at eval).
# FLOPs a trained token matched to config/shakespeare_char_gpt.py and _grt.py (tests/test_configs.py checks it).
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-rung1'
model_type = 'rung1'
n_prelude, n_core, n_recur, n_coda = 0, 1, 11, 0
