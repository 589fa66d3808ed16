# config/depth_gpt_params.py (3 layers, the GRT's non-embedding parameters) with the local attention of
# config/depth_grt_local.py: each layer sees a token and the one before it.
from config.depth_gpt_params import *

out_dir = 'out-depth-gpt-params-local'
attn_window = 2
