# grt_local with the gate removed: h = Core(W_proj [h + eps_x ; e]) (model_type 'rung4', baselines.py),
# the same layout, training depths and local attention. The ablation that asks what the gate adds.
from config.depth.recipe import *

out_dir = 'out-depth-loop-local'
model_type = 'rung4'
n_prelude, n_core, n_recur, n_coda = 1, 1, 4, 1
train_depth = 'heavy'
attn_window = 2
