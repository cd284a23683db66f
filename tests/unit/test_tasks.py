"""The built-in tasks: determinism from the seed, data, loss, and loading through entry points."""

from __future__ import annotations

import math

import pytest
import torch

from swarmrun.node.tasks.base import Task, batch_len, load_task_class
from swarmrun.protocol.errors import TaskError
from swarmrun.node.tasks.char_lm import CharLMTask
from swarmrun.node.tasks.synthetic import SyntheticTask

pytestmark = pytest.mark.timeout(60)

SMALL_LM = {"seq_len": 16, "d_model": 32, "n_layer": 1, "n_head": 2}


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype == torch.float32, key
        assert torch.equal(sa[key], sb[key]), key


def differs(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def corpus_dir(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"def hello(world):\n    return world * 2\n" * 40)
    (root / "sub" / "b.py").write_bytes(bytes(range(256)) * 8)
    return root


def lm(corpus, seed=0, **args) -> CharLMTask:
    return CharLMTask({"corpus": str(corpus), **SMALL_LM, **args}, seed)


# --- synthetic ------------------------------------------------------------------------------
def test_synthetic_same_seed_same_model_and_data():
    a, b = SyntheticTask({}, 7), SyntheticTask({}, 7)
    assert_same_state(a.build_model(), b.build_model())
    assert a.data_fingerprint() == b.data_fingerprint()
    assert len(a.data_fingerprint()) == 64
    xa, ya = a.get_batch(range(a.num_examples()))
    xb, yb = b.get_batch(range(b.num_examples()))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_synthetic_other_seed_other_model_and_data():
    a, b = SyntheticTask({}, 7), SyntheticTask({}, 8)
    assert differs(a.build_model(), b.build_model())
    assert a.data_fingerprint() != b.data_fingerprint()
    assert not torch.equal(a.get_batch([0])[0], b.get_batch([0])[0])
    assert SyntheticTask({"noise": 0.5}, 7).data_fingerprint() != a.data_fingerprint()


def test_synthetic_evaluates_on_held_out_examples():
    a, b = SyntheticTask({"eval_examples": 256}, 7), SyntheticTask({"eval_examples": 256}, 7)
    x, y = a.eval_batch()
    assert x.shape == (256, 16) and y.shape == (256, 1)
    assert torch.equal(x, b.eval_batch()[0]) and torch.equal(y, b.eval_batch()[1])  # fixed by the seed
    train_x, _ = a.get_batch(range(a.num_examples()))
    assert not (x[:, None, :] == train_x[None, :, :]).all(-1).any()  # not one of them is a training example
    # the training data, and so the data fingerprint, do not depend on the held-out examples
    assert torch.equal(train_x, SyntheticTask({"eval_examples": 3}, 7).get_batch(range(a.num_examples()))[0])
    assert a.data_fingerprint() == SyntheticTask({}, 7).data_fingerprint()
    model = a.build_model()
    assert a.evaluate(model, torch.device("cpu")) == pytest.approx(float(a.loss(model, (x, y)).detach()))
    with pytest.raises(TaskError):
        SyntheticTask({"eval_examples": 0}, 7)


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    SyntheticTask({}, 1).build_model()
    CharLMTask({"max_bytes": 10_000, **SMALL_LM}, 1).build_model()
    assert torch.equal(before, torch.get_rng_state())
    # and the global RNG does not leak into the model
    torch.manual_seed(999)
    assert_same_state(SyntheticTask({}, 1).build_model(), SyntheticTask({}, 1).build_model())


def test_synthetic_batch_shapes_and_determinism():
    task = SyntheticTask({"dim": 5, "num_examples": 100}, 0)
    assert task.num_examples() == 100
    x, y = task.get_batch([3, 1, 99, 3])
    assert x.shape == (4, 5) and y.shape == (4, 1)
    assert x.dtype == y.dtype == torch.float32
    assert batch_len((x, y)) == 4
    assert torch.equal(x[0], x[3])
    x2, y2 = task.get_batch([3, 1, 99, 3])
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(IndexError):
        task.get_batch([100])
    with pytest.raises(IndexError):
        task.get_batch([-1])


def test_synthetic_training_lowers_loss():
    task = SyntheticTask({}, 0)
    hp = dict(task.hparam_defaults)
    model = task.build_model()
    opt = task.build_optimizer(model, hp)
    start = task.evaluate(model, torch.device("cpu"))
    assert math.isfinite(start)
    for step in range(20):
        loss = task.loss(model, task.get_batch(range(step * 64, step * 64 + 64)))
        assert loss.dim() == 0 and math.isfinite(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert task.evaluate(model, torch.device("cpu")) < 0.5 * start


# --- char-lm --------------------------------------------------------------------------------
def test_char_lm_same_seed_same_model(corpus_dir):
    a, b = lm(corpus_dir, seed=3), lm(corpus_dir, seed=3)
    assert_same_state(a.build_model(), b.build_model())
    assert a.data_fingerprint() == b.data_fingerprint()
    c = lm(corpus_dir, seed=4)
    assert differs(a.build_model(), c.build_model())
    assert c.data_fingerprint() == a.data_fingerprint()  # the data does not depend on the seed


def test_char_lm_windows(corpus_dir):
    task = lm(corpus_dir)
    corpus = (corpus_dir / "a.txt").read_bytes() + (corpus_dir / "sub" / "b.py").read_bytes()
    assert task.num_examples() == len(corpus) // 17
    x, y = task.get_batch([0, 2])
    assert x.shape == y.shape == (2, 16) and x.dtype == y.dtype == torch.int64
    assert bytes(x[0].tolist()) == corpus[:16] and bytes(y[0].tolist()) == corpus[1:17]
    assert bytes(x[1].tolist()) == corpus[34:50]  # non-overlapping windows of seq_len + 1
    assert torch.equal(task.get_batch([2])[0], x[1:])
    last = task.num_examples() - 1
    assert task.get_batch([last])[1].shape == (1, 16)
    with pytest.raises(IndexError):
        task.get_batch([last + 1])


def test_char_lm_loss_and_backward(corpus_dir):
    task = lm(corpus_dir)
    model = task.build_model()
    loss = task.loss(model, task.get_batch(range(8)))
    assert loss.dim() == 0 and abs(loss.item() - math.log(256)) < 0.5  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's mixed precision, here on CPU
        assert math.isfinite(task.loss(model, task.get_batch(range(8))).item())


def test_char_lm_eval_indices_spread(corpus_dir):
    small = lm(corpus_dir, seq_len=64)
    assert list(small.eval_indices()) == list(range(small.num_examples()))
    big = lm(corpus_dir, seq_len=4)
    idx = list(big.eval_indices())
    n = big.num_examples()
    assert n > 64 and len(idx) == len(set(idx)) == 64 and idx[0] == 0 and idx[-1] > n * 0.9
    assert math.isfinite(big.evaluate(big.build_model(), torch.device("cpu")))


def test_char_lm_fingerprint_follows_the_corpus(corpus_dir, tmp_path):
    base = lm(corpus_dir).data_fingerprint()
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_bytes(b"something else entirely " * 100)
    assert lm(other).data_fingerprint() != base
    # the same bytes in another directory: the same fingerprint; hidden files are left out
    copy = tmp_path / "copy"
    (copy / "sub").mkdir(parents=True)
    (copy / "a.txt").write_bytes((corpus_dir / "a.txt").read_bytes())
    (copy / "sub" / "b.py").write_bytes((corpus_dir / "sub" / "b.py").read_bytes())
    (copy / ".hidden").write_bytes(b"ignored")
    assert lm(copy).data_fingerprint() == base
    assert lm(corpus_dir, seq_len=8).data_fingerprint() != base
    assert lm(corpus_dir, max_bytes=500).data_fingerprint() != base


def test_char_lm_max_bytes_caps_the_corpus(corpus_dir):
    task = lm(corpus_dir, max_bytes=100)
    assert task.corpus_bytes == 100 and task.num_examples() == 100 // 17


def test_char_lm_bad_corpus(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        lm(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="no non-empty file"):
        lm(tmp_path / "empty")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "t.txt").write_bytes(b"short")
    with pytest.raises(TaskError, match="fewer than one window"):
        lm(tmp_path / "tiny")


def test_char_lm_bad_args(corpus_dir):
    with pytest.raises(TaskError, match="multiple of n_head"):
        lm(corpus_dir, d_model=30, n_head=4)
    with pytest.raises(TaskError, match="dropout"):
        lm(corpus_dir, dropout=1.0)
    with pytest.raises(TaskError, match="seq_len"):
        lm(corpus_dir, seq_len=0)


def test_char_lm_default_corpus():
    """The default corpus is swarmrun's own sources: fixed by the installed version, not by the Python running it
    (the stdlib one differed between the CPU and CUDA images, whose peers then refused each other)."""
    from swarmrun.node.tasks.char_lm import package_corpus

    a, b = CharLMTask({}, 0), CharLMTask({}, 0)
    assert a.num_examples() > 5_000
    assert a.corpus_bytes == len(package_corpus(4_000_000)) < 4_000_000
    assert a.data_fingerprint() == b.data_fingerprint()
    stdlib = CharLMTask({"corpus": "stdlib", "max_bytes": 100_000}, 0)
    assert stdlib.corpus_bytes == 100_000 and stdlib.data_fingerprint() != a.data_fingerprint()
    x, y = a.get_batch([0, a.num_examples() - 1])
    assert x.shape == (2, 64) and torch.equal(x[:, 1:], y[:, :-1])


# --- loading and arguments ------------------------------------------------------------------
def test_load_through_entry_points():
    assert load_task_class("char-lm") is CharLMTask
    assert load_task_class("synthetic") is SyntheticTask
    with pytest.raises(TaskError, match="not installed"):
        load_task_class("no-such-task")


@pytest.mark.parametrize("cls", [SyntheticTask, CharLMTask])
def test_hparam_defaults_complete(cls):
    assert issubclass(cls, Task)
    assert set(Task.hparam_defaults) <= set(cls.hparam_defaults)
    assert cls.hparam_defaults["target_batch_size"] == 64


def test_args_are_coerced_and_checked(corpus_dir):
    task = SyntheticTask({"dim": "4", "noise": "0.5", "num_examples": 10}, 0)
    assert task.args == {"dim": 4, "hidden": 32, "num_examples": 10, "noise": 0.5, "eval_examples": 1024}
    assert task.get_batch([0])[0].shape == (1, 4)
    with pytest.raises(TaskError, match="unknown"):
        SyntheticTask({"width": 3}, 0)
    with pytest.raises(TaskError, match="must be a"):
        SyntheticTask({"dim": "wide"}, 0)
    with pytest.raises(TaskError, match="must be a float"):
        lm(corpus_dir, dropout="lots")
    with pytest.raises(TaskError, match="finite"):
        SyntheticTask({"noise": "nan"}, 0)
    with pytest.raises(TaskError, match=">= 1"):
        SyntheticTask({"num_examples": 0}, 0)
    assert lm(corpus_dir, d_model="32").args["d_model"] == 32


def test_make_task_takes_a_schedule_and_an_evaluation():
    """An existing script's constant LR and validation loss, without a Task subclass."""
    import swarmrun
    from swarmrun.node.api import TrainResult

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    held_out = (torch.randn(8, 4), torch.randn(8, 1))

    def mse(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    for schedule, lrs in (("constant", [0.5, 0.5, 0.5]), (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                          [0.5, 0.25, 0.125])):
        cls = swarmrun.make_task("api-t", model=lambda: torch.nn.Linear(4, 1), dataset=data, loss=mse,
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.5), scheduler=schedule,
                                 evaluate=lambda m: mse(m, held_out).item())
        task = cls({}, 0)
        model = task.build_model()
        opt = task.build_optimizer(model, cls.hparam_defaults)
        sched = task.build_scheduler(opt, cls.hparam_defaults)
        seen = []
        for _ in range(3):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert seen == pytest.approx(lrs)
        assert task.evaluate(model, torch.device("cpu")) == pytest.approx(mse(model, held_out).item())
        assert model.training  # evaluate() restores the mode
    with pytest.raises(ValueError):
        swarmrun.make_task("api-u", model=lambda: torch.nn.Linear(4, 1), dataset=data, loss=mse, scheduler="linear")
    with pytest.raises(TypeError, match="matchmaking_tme"):  # a misspelt setting fails before anything starts
        swarmrun.train(cls, "r", create=True, matchmaking_tme=1.0)
    assert str(TrainResult(reason="finished", step=3, state_hash="h", model=None)) == "finished"
