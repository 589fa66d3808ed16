# Ablation ladder rung 1, recurrence alone: no prelude or coda, h = Core(h) from h0 = wte(x) + wpe,
# r ~ Uniform{1..11} in training (11 at eval).
# FLOPs: 8.26 MFLOP a trained token, 1.00x config/shakespeare_char_gpt.py, 0.99x config/shakespeare_char_grt.py.
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-rung1'
model_type = 'rung1'
n_prelude, n_core, n_recur, n_coda = 0, 1, 11, 0
