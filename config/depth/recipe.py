# The depth-task recipe that every config/depth/*.py starts from, then adds its model: a task of
# experiments/depth_tasks.py drawn on the fly (no data files), width 64, block 64, batch 32: a run of
# 2,000 iterations takes minutes on one CPU core (each run's ms a step: results/depth/compose/seeds/).
#   python train.py config/depth/grt_local.py                    # S3 running products, difficulties 1..4
#   python train.py config/depth/grt_local.py --dataset=task:pointer
#   python -m experiments.depth_eval --out_dir=out-depth-grt-local --split=dev   # choose on dev (d = 5, 6) alone
dataset = 'task:compose'  # 'task:compose', 'task:pointer' or 'task:sum' (experiments/depth_tasks.py)
difficulty = 4  # train and validate on answers that need 1..4 sequential steps
n_head = 4
n_embd = 64
block_size = 64
dropout = 0.0  # every batch is new: nothing to overfit

batch_size = 32
gradient_accumulation_steps = 1
max_iters = 2000
lr_decay_iters = 0  # decay over max_iters
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 100
beta2 = 0.99
weight_decay = 0.1

eval_interval = 500
eval_iters = 5
log_interval = 100
device = 'cpu'
dtype = 'auto'
compile = False
