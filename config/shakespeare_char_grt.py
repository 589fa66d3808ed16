# A GRT (1 + 1x5 + 1) on Tiny Shakespeare's characters: about 7.5 minutes on a 2-vCPU Intel Xeon in fp32
# (other CPUs: docs/training.md, The quick-start pair).
#   python train.py config/shakespeare_char_grt.py     (prepares data/shakespeare_char/ if missing)
#   python sample.py --out_dir=out-shakespeare-char-grt
# FLOPs: 2.79 MFLOP forward a token at the mean training depth r = 3, +1.2% over config/shakespeare_char_gpt.py.
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-grt'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 1, 5, 1  # R = 5: training draws r ~ Uniform{1..5}; eval and sampling use 5
learning_rate = 8e-3  # the study's tuned rate for the GRT (results/study/tune.md; the recipe's 1e-3 is below it)
