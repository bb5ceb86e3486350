"""The GEMM floor of a cell: how long this machine's BLAS takes for the weight matrix products that
one step of the cell cannot avoid, timed alone, shape by shape.

Any implementation of the step, groupwise or TRL, multiplies by every weight matrix for every token
it generates and trains on; nothing else is counted here (not attention's score and value products,
not a single elementwise op), so the floor is a lower bound on the step time, and
``TRL s/step / floor`` bounds the speed-up any implementation on this BLAS could reach over TRL.

The work counted is the least the cell needs:
* generation: each group's prompt prefilled once, then ``length - 1`` decode steps over all
  ``prompts x G`` rows (the bench's completions are fixed-length), the output head on every step;
* training, per micro-batch of ``micro`` groups and per epoch (``mu``): the forward on each prompt
  once plus every completion token, the output head on completion tokens only, and the backward's
  two products per weight (input gradient, weight gradient);
* with a KL term, one more forward for the reference model.

Each distinct ``[M,K] x [K,N]`` product is timed with ``torch.mm`` into a reused output (best of a
few repeats), so the floor is also free of allocation costs.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from common import MODELS, Cell, train_rows


def _layer_products(config: dict[str, Any], tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of one decoder layer's weight products for ``tokens`` rows: q|k|v, o, gate|up, down."""
    d, hd = config["hidden_size"], config["head_dim"]
    heads, kv_heads, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    return [
        (tokens, d, (heads + 2 * kv_heads) * hd),
        (tokens, heads * hd, d),
        (tokens, d, 2 * inter),
        (tokens, inter, d),
    ]


def _forward(config: dict[str, Any], tokens: int, head_rows: int) -> Counter:
    products: Counter = Counter()
    for shape in _layer_products(config, tokens):
        products[shape] += config["num_hidden_layers"]
    if head_rows:
        products[(head_rows, config["hidden_size"], config["vocab_size"])] += 1
    return products


def _with_backward(forward: Counter) -> Counter:
    """The forward's products plus, per product [M,K]x[K,N], the input gradient [M,N]x[N,K] and the
    weight gradient [N,M]x[M,K] (the output head's and the first layer's input gradients included:
    the bench models tie the embedding to the head, so both are needed)."""
    products = Counter(forward)
    for (m, k, n), count in forward.items():
        products[(m, n, k)] += count
        products[(n, m, k)] += count
    return products


def step_products(cell: Cell, config: dict[str, Any], prompt_tokens: int) -> Counter:
    """{(M, K, N): count} of the weight products one step of ``cell`` needs at least."""
    rows = cell.prompts * cell.group
    products = _forward(config, cell.prompts * prompt_tokens, cell.prompts)  # prefill, last prompt position's head
    decode = _forward(config, rows, rows)  # one decode step of every row
    for shape, count in decode.items():
        products[shape] += count * (cell.length - 1)
    micro = cell.micro
    tokens = micro * prompt_tokens + micro * cell.group * cell.length  # prompt once per group
    completion = micro * cell.group * cell.length
    batches = cell.prompts // micro
    train = _with_backward(_forward(config, tokens, completion))
    for shape, count in train.items():
        products[shape] += count * batches * cell.mu
    if cell.beta > 0:
        for shape, count in _forward(config, tokens, completion).items():
            products[shape] += count * batches
    return products


def time_product(m: int, k: int, n: int, repeats: int = 5, budget_s: float = 0.3, dtype: str = "float32") -> float:
    """Best seconds of ``[m,k] @ [k,n]`` in ``dtype`` into a reused output over ``repeats``
    (fewer past ``budget_s``)."""
    import torch

    kind = getattr(torch, dtype)
    a, b, out = torch.randn(m, k, dtype=kind), torch.randn(k, n, dtype=kind), torch.empty(m, n, dtype=kind)
    torch.mm(a, b, out=out)  # warm: MKL's first call per shape sets up its kernels
    best, end = float("inf"), time.perf_counter() + budget_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > end:
            break
    return best


def prompt_tokens(preset: str = "tiny", sample: int = 2000) -> int:
    """Mean prompt length in tokens over the first ``sample`` training prompts (the bench models share
    one tokenizer), rounded: the floor's prefill and training count it once per group."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / preset, local_files_only=True)
    prompts = [row["prompt"] for row in train_rows()[:sample]]
    return round(sum(len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]) / len(prompts))


def gemm_floors(
    cells: list[Cell], configs: dict[str, dict[str, Any]], prompt_tokens: int, threads: int
) -> dict[str, float]:
    """Seconds of GEMM floor per cell name, in the cell's products' dtype (``cell.matmul``: the bf16 rows'
    floor is timed in bfloat16); a shape and dtype shared between cells is timed once."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    timed: dict[tuple[tuple[int, int, int], str], float] = {}
    floors = {}
    try:
        for cell in cells:
            total = 0.0
            for shape, count in step_products(cell, configs[cell.preset], prompt_tokens).items():
                if (shape, cell.matmul) not in timed:
                    timed[shape, cell.matmul] = time_product(*shape, dtype=cell.matmul)
                total += count * timed[shape, cell.matmul]
            floors[cell.name] = total
    finally:
        torch.set_num_threads(previous)
    return floors
