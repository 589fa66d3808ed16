# Ablation ladder rung 4, + prelude re-injection: h = Core(W_proj [h + eps_x ; e]), r ~ Uniform{1..6} in
# training (6 at eval). Rung 5 is the full GRT (experiments/study.py's grt).
# FLOPs a trained token matched to config/shakespeare_char_gpt.py and _grt.py (tests/test_configs.py checks it).
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-rung4'
model_type = 'rung4'
n_prelude, n_core, n_recur, n_coda = 1, 1, 6, 1
