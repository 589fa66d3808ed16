# A dense 6-layer GPT on Tiny Shakespeare's characters, the quick-start GRT's dense twin (fp32 on a CPU;
# its loss and time beside the GRT's: results/quickstart/RESULTS.md, python -m experiments.quickstart).
#   python train.py config/shakespeare_char_gpt.py     (prepares data/shakespeare_char/ if missing)
#   python sample.py --out_dir=out-shakespeare-char-gpt
# FLOPs: 2.75 MFLOP forward a token; its GRT twin config/shakespeare_char_grt.py costs 2.79 (+1.2%).
from config.recipe_shakespeare_char import *

out_dir = 'out-shakespeare-char-gpt'
model_type = 'gpt'
n_layer = 6
learning_rate = 4e-3  # the dense model's rate in the study (experiments/study.py's LEARNING_RATES); the recipe's is 1e-3
