# A dense GPT with the depth GRT's non-embedding parameters: 3 layers, 0.60M (the GRT 0.68M; 4 layers 0.79M).
from config.depth_recipe import *

out_dir = 'out-depth-gpt-params'
model_type = 'gpt'
n_layer = 3
