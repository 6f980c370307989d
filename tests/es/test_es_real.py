"""`fucina eval` on a real pretrained GGUF (SmolLM2-135M-Instruct Q4_1): the base model solves some one-digit
additions, and 1 and 2 workers give the same rewards. Slow; needs FUCINA_REAL_GGUFS (tools/fetch_real_ggufs.py)."""
import json
import os

import pytest

from pipeline.cli import main

REAL = os.environ.get("FUCINA_REAL_GGUFS")
MODEL = os.path.join(REAL or "", "SmolLM2-135M-Instruct.Q4_1.gguf")
LASTINT = ("import re\ndef reward(prompt, completion, reference):\n"
           "    found = re.findall(r'-?\\d+', completion.replace(',', ''))\n"
           "    return 1.0 if found and found[-1] == reference.strip() else 0.0\n")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (REAL and os.path.isfile(MODEL)), reason="FUCINA_REAL_GGUFS with SmolLM2")]


def test_real_model_eval_solves_some_and_workers_agree(tmp_path, capsys):
    data = tmp_path / "add.jsonl"
    sums = [(3, 4), (2, 5), (6, 1), (8, 1)]
    data.write_text("".join(json.dumps({"instruction": f"What is {a} + {b}? Answer with just the number.",
                                        "response": str(a + b)}) + "\n" for a, b in sums))
    (tmp_path / "lastint.py").write_text(LASTINT)
    argv = ["eval", "--model", MODEL, "--data", str(data), "--reward", f"{tmp_path / 'lastint.py'}:reward",
            "--n", "4", "--max-new-tokens", "10", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["solved"] >= 1, one  # a pretrained instruct model adds one-digit numbers, some of the time
    assert main(argv + ["--workers", "2"]) == 0
    two = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert two["rewards"] == one["rewards"]


def test_real_model_batched_nll_rewards_are_the_one_by_one_bits():
    """On the real SmolLM2 (a head big enough for the shared, tiled head products; the fixtures' are not):
    batched NLL rewards equal scoring each member alone in place, bitwise, for two member splits."""
    import numpy as np
    from pipeline.es import ESConfig
    from pipeline.finetune.build import open_text
    from pipeline.finetune.es import ESFinetune
    from pipeline.finetune.model import LoraModel, batch_loss
    from pipeline.llm import data as sft
    text = open_text(MODEL)
    samples = sft.encode_all(text.encoder, text.template, sft.PIRATE_PAIRS[:2])
    trainer = LoraModel.from_gguf(MODEL, targets=("q", "v"), rank=4, seed=2)
    cfg = ESConfig(sigma=0.05, alpha=0.05, population=4, antithetic=True, seed=3, restore_mode="snapshot")
    run = ESFinetune(trainer, samples, sft.Loader(2), cfg, batch=2, member_batch=2)
    run.iteration_step()  # B off zero
    es = run.es
    one_by_one = []
    for m in range(4):
        es.perturb(m)
        one_by_one.append(-batch_loss(trainer, samples))
        es.restore(m)
    rows = es.split(es.materialize_members(range(4)))
    for split in (1, 3):
        assert run.scorer.score_members(trainer, rows, [0, 1], split) == one_by_one, split
    assert len(set(one_by_one)) == 4 and np.isfinite(one_by_one).all()
