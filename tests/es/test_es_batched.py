"""The population as one batch: rewards bitwise equal to scoring members one by one in place, for any batch
split, any number of member processes, quantized and f32 bases (qwen2: with biases), A+B or B-only search."""
import json
import os

import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(1):
        yield


def _setup(model, search, targets=("q", "v", "down")):
    from pipeline.commands.finetune import _load_tokenizer
    from pipeline.es import ESConfig
    from pipeline.es.finetune import ESFinetune
    from pipeline.llm import data as sft
    from pipeline.llm.chat import ChatTemplate
    from pipeline.llm.finetune import Trainer
    from pipeline.llm.gguf import open_gguf
    gg = open_gguf(model)
    samples = sft.encode_all(sft.RawEncoder(_load_tokenizer(gg)), ChatTemplate.from_gguf(gg), sft.PIRATE_PAIRS[:3])
    trainer = Trainer.from_gguf(model, targets=targets, rank=4, seed=5)
    cfg = ESConfig(sigma=0.1, alpha=0.1, population=6, antithetic=True, seed=9, restore_mode="snapshot")
    return ESFinetune(trainer, samples, sft.Loader(3), cfg, batch=3, search=search), samples


@pytest.mark.parametrize("model, search", [("qwen3-mini-q8_0.gguf", "ab"), ("qwen3-mini-f32.gguf", "b"),
                                           ("qwen3-tied-q4_k_s.gguf", "ab"), ("qwen2-mini-f32.gguf", "ab")])
def test_batched_rewards_are_the_one_by_one_bits(model, search):
    from pipeline.es.batched import chunked_rewards
    from pipeline.es.finetune import batch_loss
    run, samples = _setup(os.path.join(FIXTURES, model), search)
    run.iteration_step()  # B off zero, so every factor matters
    es = run.es
    one_by_one = []
    for m in range(es.config.population):
        es.perturb(m)
        one_by_one.append(-batch_loss(run.trainer, samples))
        es.restore(m)
    rows = es.split(es.materialize_members(range(es.config.population)))
    for split in (1, 2, 4, 6):
        assert chunked_rewards(run.trainer, rows, samples, split) == one_by_one, split
    assert len(set(one_by_one)) > 1  # the members differ, so equal lists are not a coincidence


def test_member_batch_flag_same_bits_in_process_and_in_member_processes(capsys):
    model = os.path.join(FIXTURES, "qwen3-mini-q8_0.gguf")
    common = ["es-finetune", "--model", model, "--population", "6", "--batch", "2", "--max-new-tokens", "2",
              "--iterations", "2", "--threads", "0", "--json"]
    results = []
    for extra in ([], ["--member-batch", "4"], ["--member-batch", "3", "--workers", "2"]):
        assert main(common + extra) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    for r in results[1:]:
        assert r["adapters_sha256"] == results[0]["adapters_sha256"]
        assert r["reward_stats"] == results[0]["reward_stats"]
    rc = main(common + ["--member-batch", "2", "--reward", "rule:format"])
    assert rc == 2 and "one at a time" in capsys.readouterr().err
