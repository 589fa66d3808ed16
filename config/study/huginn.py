# Huginn-style heavy-tail depth sampling (baselines.py) on Tiny Shakespeare's characters:
# r = Poisson(tau) + 1, tau ~ LogNormal(log 4 - 0.125, 0.5), gradients through the last k = 3 steps.
# FLOPs: 8.26 MFLOP a trained token, 1.00x config/shakespeare_char_gpt.py, 0.99x config/shakespeare_char_grt.py.
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-huginn'
model_type = 'huginn'
n_prelude, n_core, n_recur, n_coda = 1, 1, 4, 1  # n_recur: r_mean, the log-normal's mean and the eval depth
backprop_depth = 3  # k
