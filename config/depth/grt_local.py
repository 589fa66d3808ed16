# The GRT with local attention, our extension beyond the paper's GRT (which attends to every earlier
# token): every block sees a token and the one before it (attn_window = 2), so
# each recurrence step reaches one token further back and a longer run of operands needs more steps:
# what the loop learns to do one step at a time, more steps at test time carry on (docs/depth.md).
# 1 + 1x4 + 1, heavy-tailed training depths (Huginn's, E[r] = 5) that keep the state stable past R,
# gate bias 0. Training FLOPs 1.08x config/depth/grt.py's (attention counted in full).
# The recipe of docs/depth.md, chosen on dev, adds to it: --position=none --gate_bias=3.0
# --input_difficulty=8 --n_recur=8 --backprop_depth=4 --gate_noise=1.0 --final_gate_noise=2.0 --max_iters=3000
from config.depth.recipe import *

out_dir = 'out-depth-grt-local'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 1, 4, 1
train_depth = 'heavy'
gate_bias = 0.0
attn_window = 2
