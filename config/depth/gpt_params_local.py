# config/depth/gpt_params.py (3 layers, the GRT's non-embedding parameters) with the local attention of
# config/depth/grt_local.py: each layer sees a token and the one before it.
from config.depth.gpt_params import *

out_dir = 'out-depth-gpt-params-local'
attn_window = 2
