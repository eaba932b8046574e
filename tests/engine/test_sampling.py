import torch

from predictor.engine.sampling import draw, finite_rows, greedy, make_generator
from predictor.types import SamplingParams


def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 1000) * 4


def test_greedy_is_argmax() -> None:
    x = logits()
    assert greedy(x) == x.argmax(dim=-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    x = logits()[0]
    top = int(x.argmax())
    for p in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ):
        assert {draw(x, p, make_generator(s, torch.device("cpu"))) for s in range(20)} == {top}


def test_seeded_draws_repeat_and_differ_across_seeds() -> None:
    x = logits()[1]
    p = SamplingParams(temperature=1.5, top_p=0.95, top_k=200)
    a = [draw(x, p, make_generator(7, torch.device("cpu"))) for _ in range(3)]
    assert len(set(a)) == 1
    gen = make_generator(7, torch.device("cpu"))
    seq = [draw(x, p, gen) for _ in range(30)]
    assert len(set(seq)) > 1


def test_extreme_temperatures_stay_finite() -> None:
    x = logits()[2]
    top = int(x.argmax())
    tiny = SamplingParams(temperature=1e-300)  # would overflow without the max shift
    assert draw(x, tiny, make_generator(1, torch.device("cpu"))) == top
    huge = SamplingParams(temperature=100.0)
    assert 0 <= draw(x, huge, make_generator(1, torch.device("cpu"))) < 1000


def test_top_k_keeps_only_the_k_best() -> None:
    x = logits()[0]
    best = set(torch.topk(x, 5).indices.tolist())
    gen = make_generator(3, torch.device("cpu"))
    assert {draw(x, SamplingParams(temperature=5.0, top_k=5), gen) for _ in range(200)} <= best


def test_finite_rows() -> None:
    x = logits()
    x[1, 3] = float("nan")
    assert finite_rows(x) == [True, False, True]


def test_top_p_below_float32_keeps_the_best_token() -> None:
    x = logits()[0]
    p = SamplingParams(temperature=40.0, top_p=2.2e-308)
    assert draw(x, p, make_generator(0, torch.device("cpu"))) == int(x.argmax())
