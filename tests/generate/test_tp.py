"""Tensor-parallel generation on 2 CPU ranks (gloo) through the TP plans of
tidal/parallel/parallelize.py, without sequence parallel: greedy tokens equal one process's,
logits within fp32 tolerance."""

import torch
import torch.distributed as dist

from tests.generate.conftest import tiny_model
from tests.parallel._launch import run_ranks
from tidal.generate import Generator, GeneratorConfig, SamplingParams

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42]]
PARAMS = [
    SamplingParams(temperature=0, max_new_tokens=12),
    SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=3),
    SamplingParams(temperature=0, max_new_tokens=10),
]


def _generate_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from tidal.models import Transformer, get_flavor
    from tidal.parallel.parallelize import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            model = Transformer(get_flavor("tiny", max_seq_len=128))
        apply_tp(model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)  # layout-independent: the same weights as one process
        gen = Generator(model, config=GeneratorConfig(max_batch=3, max_seq_len=64))
        groups = gen.generate(PROMPTS, PARAMS)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPTS[1]]))
        # Weights from a full (plain) state dict are sliced into the DTensor parameters.
        gen.load_weights(tiny_model(seed=1).state_dict(), version=1)
        reloaded = gen.generate(PROMPTS[:1], PARAMS[:1])
        return (
            [[s.completion_ids for s in g] for g in groups],
            logits,
            reloaded[0][0].completion_ids,
        )
    finally:
        dist.destroy_process_group()


def test_tp2_greedy_equals_one_process(tmp_path):
    results = run_ranks(2, _generate_tp, tmp_path=tmp_path)
    model = tiny_model()
    gen = Generator(model, config=GeneratorConfig(max_batch=3, max_seq_len=64))
    ref = [[s.completion_ids for s in g] for g in gen.generate(PROMPTS, PARAMS)]
    with torch.no_grad():
        ref_logits = model(torch.tensor([PROMPTS[1]]))
    other = Generator(tiny_model(seed=1)).generate(PROMPTS[:1], PARAMS[:1])[0][0]
    for ids, logits, reloaded in results:
        assert ids[0] == ref[0] and ids[2] == ref[2]  # greedy
        assert ids[1] == ref[1]  # sampled: the same noise on every rank and in one process
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        assert reloaded == other.completion_ids
