"""
Depth tasks: synthetic sequences whose answers need a known number of sequential steps, drawn on the
fly from a torch.Generator (no files, no download), for `python train.py ... --dataset=task:NAME
--difficulty=D` and `python -m experiments.depth_eval`.

A sequence of block_size tokens holds answers at many positions (dense supervision): y is the answer
there and -1 elsewhere, so the loss reads only the answers, and `steps` says how many sequential steps
each answer needs (0 elsewhere). Training draws each query's steps from 1..D; evaluation at difficulty
d draws them all equal to d and scores the answers of exactly d steps.

Each task's solve() works an answer out from the tokens alone, one step at a time, counting its steps:
the tests check the generator's answers and step counts against it.
"""

from itertools import accumulate, permutations

import torch

from common import fail


class Pointer:
    """Pointer chasing: the answer at the j-th dot after a node q is the node j hops after q, which
    needs j look-ups in the successor list at the start.

    Layout: `nodes` nodes on one random cycle, each written as the pair (node, successor) in random
    order, a separator, then queries to the end of the block: a node and as many dots as it has hops.
    On one cycle of n nodes, fewer than n hops never come back to the start, so no answer is the
    query itself; chance is 1 / nodes at every difficulty."""

    def __init__(self, block_size, nodes=16):
        self.block_size, self.nodes = block_size, nodes
        self.sep, self.dot = nodes, nodes + 1  # tokens 0 .. nodes - 1 are the nodes
        self.vocab_size, self.chance = nodes + 2, 1 / nodes
        self.max_difficulty = min(nodes - 1, block_size - 2 * nodes - 2)  # no wrap; one whole query fits

    def example(self, gen, lo, hi):
        n = self.nodes
        cycle = torch.randperm(n, generator=gen).tolist()  # cycle[i] -> cycle[i + 1] -> ...
        place = {node: i for i, node in enumerate(cycle)}
        listed = torch.randperm(n, generator=gen).tolist()
        tokens = [t for node in listed for t in (node, cycle[(place[node] + 1) % n])] + [self.sep]
        answers, steps = [-1] * len(tokens), [0] * len(tokens)
        queries = torch.randint(n, (self.block_size,), generator=gen).tolist()
        hops = torch.randint(lo, hi + 1, (self.block_size,), generator=gen).tolist()
        for q, h in zip(queries, hops):
            if len(tokens) >= self.block_size:
                break
            tokens += [q] + [self.dot] * h
            answers += [-1] + [cycle[(place[q] + j) % n] for j in range(1, h + 1)]  # j places on along the cycle
            steps += range(h + 1)
        return tokens[:self.block_size], answers[:self.block_size], steps[:self.block_size]

    def solve(self, tokens):
        """(answers, steps): follow the successor list one look-up per dot."""
        end = tokens.index(self.sep)
        successor = dict(zip(tokens[0:end:2], tokens[1:end:2]))
        answers, steps = [-1] * len(tokens), [0] * len(tokens)
        node, looked_up = None, 0
        for i in range(end + 1, len(tokens)):
            if tokens[i] == self.dot:
                node, looked_up = successor[node], looked_up + 1
                answers[i], steps[i] = node, looked_up
            else:
                node, looked_up = tokens[i], 0
        return answers, steps


class RunningSum:
    """Running sums mod m: the answer at the j-th operand after a reset token is the sum of those j
    operands mod m, which needs j additions.

    Layout: runs to the end of the block, each a reset token and its operands (0 .. m - 1); the last
    run may be cut short by the block's end. Chance is 1 / m."""

    def __init__(self, block_size, m=5):
        self.block_size, self.m = block_size, m
        self.reset = m  # tokens 0 .. m - 1 are the operands
        self.vocab_size, self.chance = m + 1, 1 / m
        self.max_difficulty = block_size - 1

    def combine(self, total, operand):
        return (total + operand) % self.m

    def example(self, gen, lo, hi):
        operands = torch.randint(self.m, (self.block_size,), generator=gen).tolist()
        lengths = torch.randint(lo, hi + 1, (self.block_size,), generator=gen).tolist()
        tokens, answers, steps = [], [], []
        for length in lengths:
            if len(tokens) >= self.block_size:
                break
            run = operands[len(tokens) + 1: len(tokens) + 1 + length]  # the operands drawn for these positions
            tokens += [self.reset] + run
            answers += [-1] + list(accumulate(run, self.combine))
            steps += range(len(run) + 1)
        return tokens[:self.block_size], answers[:self.block_size], steps[:self.block_size]

    def solve(self, tokens):
        """(answers, steps): combine the operands one at a time from the last reset."""
        answers, steps = [-1] * len(tokens), [0] * len(tokens)
        total, combined = 0, 0  # token 0 is the identity: 0 mod m, and compose's unchanged order
        for i, token in enumerate(tokens):
            if token == self.reset:
                total, combined = 0, 0
            else:
                total, combined = self.combine(total, token), combined + 1
                answers[i], steps[i] = total, combined
        return answers, steps


class Compose(RunningSum):
    """Running products of permutations of 3 items (the group S3), laid out as RunningSum: the answer
    at the j-th operand after a reset is the permutation that applying those j in turn makes, which
    needs j compositions. Unlike a sum, it depends on the operands' order, so no average over the run
    gives it: state tracking. S3 is the smallest group where order matters; being solvable, it still
    admits constant-depth shortcuts (Liu et al. 2023), which S5 would not (Merrill et al. 2024).
    Tokens 0 .. 5 are the permutations, 0 the identity; chance is 1/6."""

    PERMUTATIONS = list(permutations(range(3)))

    def __init__(self, block_size):
        super().__init__(block_size, m=len(self.PERMUTATIONS))

    def combine(self, total, operand):
        """The permutation `total`, then `operand`: item i goes to operand[total[i]]."""
        first, then = self.PERMUTATIONS[total], self.PERMUTATIONS[operand]
        return self.PERMUTATIONS.index(tuple(then[first[i]] for i in range(3)))


TASKS = {'pointer': Pointer, 'sum': RunningSum, 'compose': Compose}


def make_task(name, block_size):
    """The task called name (a 'task:' prefix is dropped) for sequences of block_size tokens."""
    name = name.removeprefix('task:')
    if name not in TASKS:
        fail(f"unknown depth task {name!r}; known: {', '.join(TASKS)} (e.g. --dataset=task:compose)")
    return TASKS[name](block_size)


class TaskBatches:
    """Batches of a task whose answers need lo..hi steps, like common.Batches: get(generator) -> (x, y),
    (batch_size, block_size) on device, drawn only from the generator, so a batch is reproducible.
    scored < hi keeps the inputs of lo..hi steps but only the answers of at most scored steps in y."""

    def __init__(self, task, batch_size, device, lo, hi, scored=None):
        if not 1 <= lo <= hi <= task.max_difficulty:
            fail(f"difficulties {lo}..{hi} do not fit {type(task).__name__} at block_size {task.block_size}: "
                 f"they must lie in 1..{task.max_difficulty}; lower the difficulty or raise block_size")
        self.task, self.batch_size, self.device, self.lo, self.hi = task, batch_size, device, lo, hi
        self.scored = hi if scored is None else scored
        self.vocab_size = task.vocab_size

    def sample(self, generator):
        """(x, y, steps): tokens, answers (-1 elsewhere) and each answer's steps (0 elsewhere)."""
        rows = [self.task.example(generator, self.lo, self.hi) for _ in range(self.batch_size)]
        x, y, steps = (torch.tensor(column).to(self.device) for column in zip(*rows))
        y = y.masked_fill(steps > self.scored, -1)
        return x, y, steps

    def get(self, generator):
        x, y, _ = self.sample(generator)
        return x, y


def task_batches(name, block_size, batch_size, device, seed, difficulty, input_difficulty=0):
    """(train, val) sources for train.py's dataset='task:NAME', both scoring the answers of 1..difficulty
    steps, in inputs whose queries need 1..input_difficulty (0: difficulty). They are one source:
    train.py draws training and evaluation batches from generators seeded on different keys, so they
    never repeat each other; seed is not needed (accepted for train.py's call)."""
    if not isinstance(difficulty, int) or isinstance(difficulty, bool) or difficulty < 1:
        fail(f"a depth task needs difficulty = an int D >= 1 (it trains on 1..D), got {difficulty!r}; "
             f"e.g. --difficulty=4")
    if not isinstance(input_difficulty, int) or isinstance(input_difficulty, bool) or \
            input_difficulty and input_difficulty < difficulty:
        fail(f"input_difficulty must be 0 (the difficulty) or an int >= difficulty = {difficulty}, "
             f"got {input_difficulty!r}; e.g. --input_difficulty={2 * difficulty}")
    source = TaskBatches(make_task(name, block_size), batch_size, device, 1, input_difficulty or difficulty,
                         scored=difficulty)
    return source, source
