"""ES-spirals: the batched scorer against the model, batch-composition invariance (the runs: test_es_runtime.py)."""
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline.autograd import Tensor
from pipeline.es.spirals import SpiralsTask, spirals_config
from pipeline.models.spirals import accuracy


def _task(**cfg):
    return SpiralsTask(spirals_config(population=cfg.pop("population", 16), **cfg), model_seed=3)


def test_batched_scorer_matches_the_model_forward():
    task = _task()
    ce, acc = task.score_rows(task.trainer.flat_params()[None])
    logits = task.model(Tensor(task.X)).data.astype(np.float64)
    want_ce = np.mean(np.logaddexp(logits[:, 0], logits[:, 1]) - logits[np.arange(400), task.y])
    assert acc[0] == accuracy(task.model, task.X, task.y)
    np.testing.assert_allclose(ce[0], want_ce, rtol=1e-5)


def test_member_rewards_do_not_depend_on_batch_composition():
    task = _task(population=40)
    with threadpool_limits(1):
        together = task.rewards(range(40))
        alone = np.array([task.rewards([m])[0] for m in (0, 17, 39)])
        shuffled = task.rewards([39, 5, 17, 0])
    assert np.array_equal(alone, together[[0, 17, 39]])
    assert np.array_equal(shuffled, together[[39, 5, 17, 0]])


def test_rewards():
    ce, acc = np.array([0.0, 5.0, 0.1]), np.array([1.0, 1.0, 0.5])
    r = SpiralsTask(spirals_config(population=4), reward="acc").reward(ce, acc)
    assert r[0] == pytest.approx(1.1) and r[1] > r[2] and np.all((r >= 0) & (r <= 1.1))
    assert np.array_equal(_task().reward(ce, acc), -ce)  # the default, "nll"
    with pytest.raises(ValueError, match="reward must be one of"):
        SpiralsTask(spirals_config(population=4), reward="bleu")

