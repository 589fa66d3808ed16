# Mixture-of-Recursions (baselines.py) on Tiny Shakespeare's characters: the middle block recursed 7 times,
# expert-choice routing with capacities 7/7, 6/7, ..., 1/7 of the tokens; eval routes by the causal routers.
# FLOPs a trained token matched to config/shakespeare_char_gpt.py and _grt.py (tests/test_configs.py checks it).
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-mor'
model_type = 'mor'
n_prelude, n_core, n_recur, n_coda = 1, 1, 7, 1  # n_recur: N_r
