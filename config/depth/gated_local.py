# grt_local with the re-injection of e removed: u = h + eps_x, then GRT's core and gate (model_type
# 'grt_no_e', baselines.py), the same layout, training depths and local attention. The ablation that
# asks what re-reading the prelude's output at every step adds.
from config.depth.grt_local import *

out_dir = 'out-depth-gated-local'
model_type = 'grt_no_e'
