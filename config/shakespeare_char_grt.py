# A GRT (1 + 1x3 + 1) on Tiny Shakespeare's characters, trained at a fixed depth with its gate half open
# at init, so that it uses its recurrence (docs/analysis.md).
#   python train.py config/shakespeare_char_grt.py     (prepares data/shakespeare_char/ if missing)
#   python sample.py --out_dir=out-shakespeare-char-grt
# FLOPs: 2.79 MFLOP forward a token (r = 3 at every step), +1.2% over config/shakespeare_char_gpt.py.
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-grt'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 1, 3, 1  # R = 3 in training, eval and sampling
train_depth = 'fixed'  # r = R at every step; the paper's r ~ Uniform{1..R} left the recurrence unused here
gate_bias = 0.0  # g starts at 0.5, not sigmoid(4) = 0.98
learning_rate = 8e-3  # the GRT's rate in the study (experiments/study.py's LEARNING_RATES); the recipe's is 1e-3
