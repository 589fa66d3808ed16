# A dense GPT with the depth GRT's training FLOPs a token: 8 layers, 2.75 MFLOP (the GRT 2.79 at r ~ U{1..8}).
from config.depth.recipe import *

out_dir = 'out-depth-gpt-flops'
model_type = 'gpt'
n_layer = 8
