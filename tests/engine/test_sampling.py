import torch

from predictor.engine.sampling import Row, make_generator, row_max, sample
from predictor.types import SamplingParams

CPU = torch.device("cpu")


def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 1000) * 4


def reference_draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """The engine's former one-row-at-a-time sampler: the batched pass must draw the same."""
    if p.temperature < 1e-4:
        return int(logits.argmax())
    scaled = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def one(x: torch.Tensor, p: SamplingParams, seed: int, output: list[int] | None = None) -> int:
    state = Row(p, make_generator(seed, CPU), output or [])
    return sample(x.unsqueeze(0), [state], ()).tokens[0]


def test_greedy_is_argmax() -> None:
    x = logits()
    rows = [Row(SamplingParams(), None, []) for _ in range(3)]
    assert sample(x, rows, ()).tokens == x.argmax(dim=-1).tolist()


def test_batched_draws_equal_the_row_by_row_reference() -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 500) * 3
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.95),
        SamplingParams(temperature=2.0, top_k=1),
    ]
    for step in range(20):
        rows = [Row(p, make_generator(100 + i, CPU), []) for i, p in enumerate(params)]
        refs = [make_generator(100 + i, CPU) for i in range(len(params))]
        for _ in range(step % 3):  # advance every stream alike
            sample(x, rows, ())
            for i, p in enumerate(params):
                reference_draw(x[i], p, refs[i])
        got = sample(x, rows, ()).tokens
        want = [reference_draw(x[i], p, refs[i]) for i, p in enumerate(params)]
        assert got == want


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    x = logits()[0]
    top = int(x.argmax())
    for p in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ):
        assert {one(x, p, s) for s in range(20)} == {top}


def test_seeded_draws_repeat_and_differ_across_seeds() -> None:
    x = logits()[1]
    p = SamplingParams(temperature=1.5, top_p=0.95, top_k=200)
    assert len({one(x, p, 7) for _ in range(3)}) == 1
    state = Row(p, make_generator(7, CPU), [])
    seq = [sample(x.unsqueeze(0), [state], ()).tokens[0] for _ in range(30)]
    assert len(set(seq)) > 1


def test_extreme_temperatures_stay_finite() -> None:
    x = logits()[2]
    top = int(x.argmax())
    assert one(x, SamplingParams(temperature=1e-300), 1) == top
    assert one(x, SamplingParams(temperature=2e-4), 1) == top  # would overflow without the shift
    assert 0 <= one(x, SamplingParams(temperature=100.0), 1) < 1000


def test_top_k_keeps_only_the_k_best() -> None:
    x = logits()[0]
    best = set(torch.topk(x, 5).indices.tolist())
    state = Row(SamplingParams(temperature=5.0, top_k=5), make_generator(3, CPU), [])
    assert {sample(x.unsqueeze(0), [state], ()).tokens[0] for _ in range(200)} <= best


def test_a_non_finite_row_fails_alone() -> None:
    x = logits()
    x[1, 3] = float("nan")
    rows = [Row(SamplingParams(temperature=1.0), make_generator(i, CPU), []) for i in range(3)]
    tokens = sample(x, rows, ()).tokens
    assert tokens[1] == -1 and tokens[0] >= 0 and tokens[2] >= 0


def test_top_p_below_float32_keeps_the_best_token() -> None:
    x = logits()[0]
    assert one(x, SamplingParams(temperature=40.0, top_p=2.2e-308), 0) == int(x.argmax())


def test_min_tokens_bans_end_of_sequence_until_reached() -> None:
    x = logits()[0]
    eos = int(x.argmax())
    short = Row(SamplingParams(min_tokens=3), None, [5, 6])
    long = Row(SamplingParams(min_tokens=3), None, [5, 6, 7])
    ignoring = Row(SamplingParams(min_tokens=3, ignore_eos=True), None, [5])
    tokens = sample(x.repeat(3, 1), [short, long, ignoring], {eos}).tokens
    assert tokens[0] != eos and tokens[1] == eos and tokens[2] == eos


def test_penalties_follow_openai_formula() -> None:
    x = torch.zeros(1, 10)
    x[0, 4], x[0, 7] = 1.0, 0.9
    # token 4 was generated twice: frequency 0.1 * 2 + presence 0.0 leaves 0.8 < 0.9
    p = SamplingParams(frequency_penalty=0.1)
    assert sample(x, [Row(p, None, [4, 4])], ()).tokens == [7]
    assert sample(x, [Row(p, None, [4])], ()).tokens == [4]  # 0.9 vs 0.9: first wins
    p = SamplingParams(presence_penalty=0.2)
    assert sample(x, [Row(p, None, [4])], ()).tokens == [7]
    assert sample(x, [Row(SamplingParams(), None, [4, 4])], ()).tokens == [4]


def test_logprobs_are_the_raw_log_softmax() -> None:
    x = logits()
    p = SamplingParams(temperature=0.5, logprobs=3, presence_penalty=1.0)
    rows = [Row(p, make_generator(0, CPU), [1]), Row(SamplingParams(), None, [])]
    result = sample(x[:2], rows, ())
    assert result.logprobs[1] is None
    assert result.logprobs[0] is not None
    chosen, top = result.logprobs[0]
    want = torch.log_softmax(x[0], dim=-1)
    assert abs(chosen - float(want[result.tokens[0]])) < 1e-5
    values, ids = torch.topk(want, 3)
    assert [t for t, _ in top] == ids.tolist()
    assert all(abs(a - b) < 1e-5 for (_, a), b in zip(top, values.tolist(), strict=True))


def test_row_max_equals_torch_max_with_ties_and_nan() -> None:
    torch.manual_seed(2)
    for vocab in (49152, 32000, 1000, 1031):
        x = torch.randn(5, vocab)
        x[1, 7] = x[1, vocab - 3] = 50.0  # a tie: the first occurrence wins
        x[2, vocab // 2] = float("nan")
        x[3, vocab - 1] = float("inf")
        values, indices = row_max(x)
        want_values, want_indices = x.max(dim=-1)
        assert torch.equal(indices, want_indices)
        assert torch.equal(values.nan_to_num(), want_values.nan_to_num())


def test_repetition_penalty_matches_transformers() -> None:
    # HF's RepetitionPenaltyLogitsProcessor over prompt + generated ids (what vLLM and TGI do)
    from transformers import RepetitionPenaltyLogitsProcessor

    x = logits()
    prompt, output = [5, 7, 7, 900], [3, 5, 11]
    expected = RepetitionPenaltyLogitsProcessor(1.7)(
        torch.tensor([prompt + output]), x[:1].clone()
    )[0]
    chosen_rows = [
        Row(SamplingParams(repetition_penalty=1.7), None, output, prompt),  # greedy, penalised
        Row(SamplingParams(), None, output, prompt),  # untouched
    ]
    greedy = sample(x[:2].clone(), chosen_rows, ()).tokens
    assert greedy[0] == int(expected.argmax()) and greedy[1] == int(x[1].argmax())
    from predictor.engine.sampling import _penalize

    penalised = _penalize(x[:1].clone(), chosen_rows[:1])[0]
    assert torch.equal(penalised, expected)
    # a penalty strong enough always moves the argmax off a token it has seen
    top = int(x[0].argmax())
    strong = Row(SamplingParams(repetition_penalty=1e6), None, [top], [])
    assert sample(x[:1].clone(), [strong], ()).tokens[0] != top


def test_logit_bias_moves_the_argmax_and_bans() -> None:
    x = torch.zeros(1, 10)
    x[0, 2] = 1.0
    p = SamplingParams(logit_bias=((7, 5.0),))
    assert sample(x, [Row(p, None, [])], ()).tokens == [7]
    banned = SamplingParams(logit_bias=((2, -100.0),))
    assert sample(x, [Row(banned, None, [])], ()).tokens == [0]
