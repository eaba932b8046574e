"""A tenant's recent answers: where a row following one drafts from, and their bounds."""

from __future__ import annotations

from predictor.engine.recent_answers import Answer, Following, RecentAnswers


def test_an_answer_is_followed_from_where_the_row_agreed_with_it() -> None:
    answer = Answer([5, 6, 1, 7, 5, 8, 1, 9], max_n=2)
    assert answer.propose([0, 1], 2, 1, 0) == ([7, 5], 1, 3)  # the first place of context [1]
    assert answer.propose([0, 1], 2, 1, 4) == ([9], 1, 7)  # the first at or after place 4
    assert answer.propose([8, 1], 2, 1, 0) == ([9], 2, 7)  # the longest context first
    assert answer.propose([0, 3], 2, 1, 0) == ([], 0, 0)  # nothing matches


def test_recent_answers_are_bounded_per_salt_and_in_all() -> None:
    answers = RecentAnswers(per_salt=2, tokens=30)
    made = [Answer([i] * 10, max_n=2) for i in range(4)]
    for answer in made[:3]:
        answers.add("a", answer)
    assert answers.of("a") == [made[2], made[1]]  # the latest first, 2 a salt
    answers.add("b", made[3])
    assert len(answers) == 3 and answers.of("b") == [made[3]]
    answers.add("c", Answer([9] * 10, max_n=2))  # 40 tokens held: the oldest of all goes
    assert answers.of("a") == [made[2]] and len(answers) == 3
    assert answers.of("d") == []


def test_a_row_moves_on_by_what_its_text_agreed_with() -> None:
    following = Following(Answer([5, 6, 1, 7, 5, 8, 1, 9], max_n=2))
    assert following.propose([0, 5], 2, 1) == ([6, 1], 1)  # the first place of context [5]
    assert following.propose([0, 5, 6, 2], 2, 1) == ([], 0)  # agreed on 6: followed to 2
    assert following.at == 2
    assert following.propose([0, 5, 6, 2, 1], 2, 1) == ([7, 5], 1)  # [1] after place 2
    assert following.propose([0, 5, 6, 2, 1, 7, 5], 2, 1) == ([8, 1], 2)  # agreed on 7, 5
    assert following.at == 5
