# The depth-task recipe that every config/depth_*.py starts from, then adds its model: a task of
# experiments/depth_tasks.py drawn on the fly (no data files), at the quick start's shapes (width 128,
# block 128, batch 32), sized to train on 2 CPU cores in at most 15 minutes (docs/depth.md).
#   python train.py config/depth_grt.py                          # pointer chasing, difficulties 1..4
#   python train.py config/depth_grt.py --dataset=task:sum       # running sums mod 5
#   python -m experiments.depth_eval --out_dir=out-depth-grt     # accuracy at difficulties 1..12, R = 1..16
dataset = 'task:pointer'  # 'task:pointer' or 'task:sum'
difficulty = 4  # train and validate on answers that need 1..4 sequential steps
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0  # every batch is new: nothing to overfit

batch_size = 32
gradient_accumulation_steps = 1
max_iters = 1500
lr_decay_iters = 0  # decay over max_iters
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99
weight_decay = 0.1

eval_interval = 250
eval_iters = 10
log_interval = 25
device = 'cpu'
dtype = 'auto'
compile = False
