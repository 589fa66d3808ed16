# Mixture-of-Recursions (baselines.py) on Tiny Shakespeare's characters: the middle block recursed 7 times,
# expert-choice routing with capacities 7/7, 6/7, ..., 1/7 of the tokens; eval routes by the causal routers.
# FLOPs: 8.38 MFLOP a trained token, 1.02x config/shakespeare_char_gpt.py, 1.00x config/shakespeare_char_grt.py.
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-mor'
model_type = 'mor'
n_prelude, n_core, n_recur, n_coda = 1, 1, 7, 1  # n_recur: N_r
