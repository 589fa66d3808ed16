# A dense GPT with the depth GRT's non-embedding parameters: 3 layers, 0.150M (the GRT 0.171M; 4 layers 0.200M).
from config.depth.recipe import *

out_dir = 'out-depth-gpt-params'
model_type = 'gpt'
n_layer = 3
