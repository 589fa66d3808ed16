# The GRT on a depth task: 1 + 1x8 + 1, training draws r ~ Uniform{1..8}; depth_eval runs it at R = 1..16.
# Train FLOPs 2.79 MFLOP a token (experiments/depth_study.py's table); 0.171M non-embedding parameters.
from config.depth.recipe import *

out_dir = 'out-depth-grt'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 1, 8, 1
