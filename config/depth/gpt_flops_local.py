# config/depth/gpt_flops.py (8 layers, the GRT's training FLOPs) with the local attention of
# config/depth/grt_local.py: each layer sees a token and the one before it.
from config.depth.gpt_flops import *

out_dir = 'out-depth-gpt-flops-local'
attn_window = 2
