# Huginn-style heavy-tail depth sampling (baselines.py) on Tiny Shakespeare's characters:
# r = Poisson(tau) + 1, tau ~ LogNormal(log 4 - 0.125, 0.5), gradients through the last k = 3 steps.
# FLOPs a trained token matched to config/shakespeare_char_gpt.py and _grt.py (tests/test_configs.py checks it).
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-huginn'
model_type = 'huginn'
n_prelude, n_core, n_recur, n_coda = 1, 1, 4, 1  # n_recur: r_mean, the log-normal's mean and the eval depth
backprop_depth = 3  # k
