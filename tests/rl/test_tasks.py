"""Tasks: the registry, disjoint train/eval splits, answer extraction, the arithmetic parser,
and the built-in tasks' problems and graders."""

import importlib.util
import itertools
import random
import re
import sys
from dataclasses import dataclass
from fractions import Fraction

import pytest

from tidal.rl import tasks as tasks_pkg
from tidal.rl.tasks import (
    TASKS,
    ExpressionError,
    Grade,
    Problem,
    Task,
    evaluate,
    extract_answer,
    get_task,
    grade_number,
    parse_number,
    register,
)
from tidal.rl.tasks.addition import format_prompt

HAS_RG = importlib.util.find_spec("reasoning_gym") is not None
needs_rg = pytest.mark.skipif(not HAS_RG, reason="pip install --no-deps reasoning-gym==0.1.25")

SPLIT_CASES = [
    ("addition", {"digits": 1}),  # 55 distinct problems: the split must still hold
    ("addition", {"digits": (2, 3)}),
    ("countdown", {"n_numbers": 3, "max_number": 20}),
    ("countdown", {}),
    pytest.param("gsm_symbolic", {}, marks=needs_rg),
    pytest.param("gsm_symbolic", {"holdout": "template"}, marks=needs_rg),
]


@pytest.fixture
def scratch_registry():
    """Registrations made by a test are removed after it."""
    before = dict(TASKS)
    yield
    TASKS.clear()
    TASKS.update(before)


# -- registry ------------------------------------------------------------------------------


def test_builtins_are_registered():
    assert {"addition", "countdown"} <= set(TASKS)
    assert get_task("addition").name == "addition"
    assert get_task("countdown", n_numbers=(2, 3)).n_numbers == (2, 3)


def test_get_task_errors_name_what_exists():
    with pytest.raises(ValueError, match=r"unknown task 'nope'; choose one of \[.*'addition'"):
        get_task("nope")
    with pytest.raises(TypeError, match=r"task 'addition' has no parameter 'digitz'.*'digits'"):
        get_task("addition", digitz=3)
    with pytest.raises(ValueError, match="Addition.digits"):
        get_task("addition", digits=0)
    with pytest.raises(ValueError, match="eval_fraction"):
        get_task("addition", eval_fraction=0.0)


def test_a_user_task_in_a_few_lines(scratch_registry):
    @register("multiply_test")
    @dataclass(kw_only=True)
    class Multiply(Task):
        digits: int = 2

        def problem(self, rng):
            a, b = (rng.randrange(10 ** (self.digits - 1), 10**self.digits) for _ in "ab")
            return Problem(f"What is {a} * {b}?", str(a * b))

        def grade(self, completion, reference):
            return grade_number(completion, reference)

    task = get_task("multiply_test", digits=3)
    prompt, reference = next(task.problems("train", seed=1))
    a, b = map(int, re.findall(r"\d+", prompt))
    assert reference == str(a * b) and 100 <= a < 1000
    assert task.grade(f"#### {a * b}", reference) == Grade(
        reward=1.0, answer=str(a * b), format_ok=True
    )

    @dataclass(kw_only=True)
    class Other(Multiply):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register("multiply_test")(Other)
    with pytest.raises(TypeError, match="Task subclasses"):
        register("not_a_task")(dict)  # type: ignore[arg-type]


# -- splits --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, params", SPLIT_CASES)
def test_train_and_eval_never_share_a_problem(name, params):
    task = get_task(name, **params)
    train = [
        p for seed in range(3) for p in itertools.islice(task.problems("train", seed=seed), 700)
    ]
    evals = list(itertools.islice(task.problems("eval", seed=0), 300))
    train_keys = {task.key(p) for p in train}
    eval_keys = {task.key(p) for p in evals}
    assert train_keys and eval_keys and not train_keys & eval_keys
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    assert all(task.split_of(p) == "train" for p in train)
    # Deterministic per seed, different across seeds.
    again = list(itertools.islice(task.problems("train", seed=0), 700))
    assert again == train[:700]
    assert train[:50] != train[700:750]


def test_streams_are_pinned():
    # Same seed, same problems in any process and release (string-seeded Random, BLAKE2
    # split); a change here silently changes everyone's eval sets.
    task = get_task("addition")
    train = [p.prompt for p in itertools.islice(task.problems("train", seed=0), 3)]
    assert train == ["What is 492 + 343?", "What is 964 + 338?", "What is 692 + 941?"]
    assert [p.prompt for p in task.eval_set(2)] == ["What is 260 + 382?", "What is 938 + 998?"]
    assert next(get_task("countdown").problems()).reference == {
        "numbers": [17, 31, 73],
        "target": 25,
    }


def test_split_fraction_and_nesting():
    small, large = get_task("addition", eval_fraction=0.05), get_task("addition", eval_fraction=0.2)
    rng = random.Random(0)
    problems = [small.problem(rng) for _ in range(4000)]
    share = sum(large.split_of(p) == "eval" for p in problems) / len(problems)
    assert 0.17 < share < 0.23
    # Raising eval_fraction only moves problems from train to eval.
    assert all(large.split_of(p) == "eval" for p in problems if small.split_of(p) == "eval")


def test_commuted_sums_share_a_split():
    task = get_task("addition")
    for a, b in [(457, 168), (12, 998), (5, 5)]:
        p, q = Problem(format_prompt(a, b), str(a + b)), Problem(format_prompt(b, a), str(a + b))
        assert task.key(p) == task.key(q) and task.split_of(p) == task.split_of(q)


def test_eval_set_is_distinct_and_fixed():
    task = get_task("addition", digits=2)
    a, b = task.eval_set(50), task.eval_set(50)
    assert a == b and len({task.key(p) for p in a}) == 50
    assert task.eval_set(20, seed=1) != a[:20]
    with pytest.raises(RuntimeError, match="distinct eval problems"):
        get_task("addition", digits=1).eval_set(60)  # 55 problems in all


def test_a_split_with_no_problems_fails_loudly(scratch_registry, monkeypatch):
    @register("constant_test")
    @dataclass(kw_only=True)
    class Constant(Task):
        def problem(self, rng):
            return Problem("What is 1 + 1?", "2")

        def grade(self, completion, reference):
            return grade_number(completion, reference)

    monkeypatch.setattr(tasks_pkg.base, "MAX_SKIPS", 50)
    task = get_task("constant_test")
    other = "train" if task.split_of(task.problem(random.Random())) == "eval" else "eval"
    with pytest.raises(RuntimeError, match=f"outside the '{other}' split"):
        next(task.problems(other))
    with pytest.raises(ValueError, match="split must be"):
        next(task.problems("test"))  # type: ignore[arg-type]


# -- answers -------------------------------------------------------------------------------

ANSWERS = [
    # (completion, expected value or None, marked)
    ("457 + 168 = 625\n#### 625", 625, True),
    ("#### 625", 625, True),
    ("####625", 625, True),
    ("#### $1,234.50 dollars", Fraction("1234.5"), True),
    ("#### -17", -17, True),
    ("#### \u221217", -17, True),  # Unicode minus
    ("#### +17", 17, True),
    ("#### 12.0", 12, True),
    ("#### 3/4", Fraction(3, 4), True),
    ("first #### 1\nthen #### 2", 2, True),  # the last marked answer
    ("#### 7\nand some 99 trailing text", 7, True),  # a marked answer beats a later number
    ("The answer is \\boxed{42}.", 42, True),
    ("\\boxed{1,000}", 1000, True),
    ("\\boxed{\\frac{3}{4}}", Fraction(3, 4), True),
    ("\\boxed{\\dfrac{-6}{4}}", Fraction(-3, 2), True),
    ("\\boxed{x = 5}", 5, True),
    ("\\boxed{{5}}", 5, True),
    ("\\fbox{8}", 8, True),
    ("#### 4\n\\boxed{5}", 5, True),  # whichever mark comes last
    ("\\boxed{5} and later\n#### 4", 4, True),
    ("\\boxed{5", 5, False),  # unclosed: not a mark, the last number still counts
    ("#### \nso it is 12", 12, False),  # an empty mark falls back to the last number
    ("#### none", None, False),
    ("so the total is 1,234.", 1234, False),
    ("costs 5.5.", Fraction("5.5"), False),
    ("10-3", 3, False),  # a binary minus is not a sign
    ("x=-5", -5, False),
    ("(-5)", -5, False),
    ("5)-3", 3, False),
    ("2x+3", 3, False),
    ("3,4,5", 5, False),  # a list, not thousands
    ("1,2345", 2345, False),
    ("50%", 50, False),
    ("-0", 0, False),
    (".5", Fraction(1, 2), False),
    ("answer: 007", 7, False),
    ("10/0", None, False),  # a zero denominator is not a number
    ("a5", None, False),  # glued to a word
    ("", None, False),
    ("no digits here", None, False),
    ("\u0663", None, False),  # Arabic-Indic three: ASCII digits only
    ("1" * 150, None, False),  # too long to be a number
    ("1" * 150 + " then 7", 7, False),
    ("#### " + "9" * 5000, None, False),  # no int-conversion blowup
]


@pytest.mark.parametrize("text, value, marked", ANSWERS)
def test_extract_answer(text, value, marked):
    ans = extract_answer(text)
    if value is None:
        assert ans is None
    else:
        assert ans is not None and ans.value == Fraction(value) and ans.marked == marked


def test_grade_number():
    assert grade_number("#### 625", "625") == Grade(reward=1.0, answer="625", format_ok=True)
    assert grade_number("#### 625.00", 625).reward == 1.0
    assert grade_number("#### 624", "625") == Grade(reward=0.0, answer="624", format_ok=True)
    assert grade_number("it is 625", "625") == Grade(reward=1.0, answer="625", format_ok=False)
    assert grade_number("it is 625", "625", strict=True).reward == 0.0
    assert grade_number("nothing", "625") == Grade(reward=0.0, answer=None, format_ok=False)
    assert grade_number("#### 2.5", "2.50").reward == 1.0
    assert grade_number("#### -3", "-3").reward == 1.0
    with pytest.raises(TypeError, match="tokenizer"):
        grade_number(None, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one number"):
        grade_number("#### 1", "1 or 2")
    assert parse_number("1,234") == 1234 and parse_number("-0.5") == Fraction(-1, 2)


def test_graders_never_raise_on_junk():
    rng = random.Random(0)
    alphabet = [
        "1",
        "23",
        "-",
        "+",
        "*",
        "/",
        "(",
        ")",
        "=",
        ",",
        ".",
        " ",
        "\n",
        "####",
        "\\boxed{",
        "}",
        "{",
        "<answer>",
        "</answer>",
        "x",
        "\u2212",
        "0",
    ]
    graders = [get_task("addition"), get_task("countdown")]
    refs = ["24", {"numbers": [1, 23, 0], "target": 24}]
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for task, ref in zip(graders, refs, strict=True):
            g = task.grade(text, ref)
            assert 0.0 <= g.reward <= 1.0


# -- the arithmetic parser -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("1 + 2 * 3", 7, [1, 2, 3]),
        ("(1 + 2) * 3", 9, [1, 2, 3]),
        ("8 - 3 - 2", 3, [8, 3, 2]),  # left-associative
        ("8 / 4 / 2", 1, [8, 4, 2]),
        ("7 / 2", Fraction(7, 2), [7, 2]),
        ("((((5))))", 5, [5]),
        ("6 \u00d7 7 \u2212 2 \u00f7 2", 41, [6, 7, 2, 2]),
        ("  12  ", 12, [12]),
    ],
)
def test_evaluate(text, value, numbers):
    assert evaluate(text) == (Fraction(value), numbers)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "end of expression"),
        ("1 +", "end of expression"),
        ("-1 + 2", "unexpected '-'"),  # no unary minus
        ("2(3)", "after a complete expression"),
        ("(1 + 2", "unbalanced"),
        ("1 + 2)", "after a complete expression"),
        ("1 / (2 - 2)", "division by zero"),
        ("1.5 * 2", "unexpected character '.'"),
        ("2 ** 3", "unexpected '\\*'"),
        ("__import__('os')", "unexpected character '_'"),
        ("1" * 20, "digits"),
        ("(" * 40 + "1" + ")" * 40, "nested"),
        ("1+" * 200 + "1", "longer than"),
    ],
)
def test_evaluate_rejects(text, match):
    with pytest.raises(ExpressionError, match=match):
        evaluate(text)


# -- addition ------------------------------------------------------------------------------


def test_addition_problems():
    task = get_task("addition", digits=(1, 4))
    seen_digits = set()
    for prompt, reference in itertools.islice(task.problems("train", seed=3), 500):
        m = re.fullmatch(r"What is (\d+) \+ (\d+)\?", prompt)
        assert m is not None, prompt
        a, b = int(m[1]), int(m[2])
        assert reference == str(a + b)
        seen_digits |= {len(m[1]), len(m[2])}
        assert not (len(m[1]) > 1 and m[1][0] == "0")
    assert seen_digits == {1, 2, 3, 4}
    assert format_prompt(457, 168) == "What is 457 + 168?"


def test_addition_grades_the_sft_format():
    task = get_task("addition")
    worked = "Add the ones: 7 + 8 = 15, carry 1.\n...\n#### 625"
    assert task.grade(worked, "625") == Grade(reward=1.0, answer="625", format_ok=True)
    assert task.grade("#### 626", "625").reward == 0.0
    assert get_task("addition", strict=True).grade("457 + 168 = 625", "625").reward == 0.0
    for bad in [(1, 2, 3), (3, 1), [0, 2], "3", 51]:
        with pytest.raises(ValueError, match="Addition.digits"):
            get_task("addition", digits=bad)
    assert get_task("addition", digits=[2, 3]).problem(random.Random(0))  # a list from a config


# -- countdown -----------------------------------------------------------------------------


def solvable(numbers, target):
    """Brute force: some combination of a sub-multiset of numbers reaches target."""
    values = [Fraction(n) for n in numbers]

    def search(pool):
        if target in pool:
            return True
        for i, j in itertools.permutations(range(len(pool)), 2):
            a, b = pool[i], pool[j]
            rest = [pool[k] for k in range(len(pool)) if k not in (i, j)]
            outs = [a + b, a - b, a * b] + ([a / b] if b else [])
            if any(search(rest + [v]) for v in outs):
                return True
        return False

    return search(values)


def test_countdown_problems_are_solvable():
    task = get_task("countdown", n_numbers=(3, 4), max_number=30)
    for prompt, ref in itertools.islice(task.problems("train", seed=0), 25):
        numbers, target = ref["numbers"], ref["target"]
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 30 for n in numbers)
        assert 1 <= target <= 999 and target not in numbers
        assert str(target) in prompt and all(str(n) in prompt for n in numbers)
        assert solvable(numbers, target)


COUNTDOWN_REF = {"numbers": [3, 25, 50, 50], "target": 225}


@pytest.mark.parametrize(
    "completion, reward, format_ok",
    [
        ("#### (50 + 25) * 3", 1.0, True),
        ("#### (50 + 25) * 3 = 225", 1.0, True),
        ("so\n#### `(50+25)*3`.", 1.0, True),
        ("<answer>(50 + 25) * 3</answer>", 1.0, True),
        ("\\boxed{(50 + 25) \u00d7 3}", 1.0, True),
        ("#### 50 * 3 + 50 + 25", 1.0, True),  # 50 given twice, used twice
        ("#### 50 * 3 + 50 + 25 - 25 + 25", 0.0, True),  # 25 used three times
        ("#### 75 * 3", 0.0, True),  # 75 is not given
        ("#### (50 + 25) * 3 + 1", 0.0, True),  # 226
        ("#### 50 / 3 * 3 * 3 + 75", 0.0, True),  # fractions fine, value 225 but 75 not given
        ("#### 225", 0.0, True),  # the target itself is not a given number
        ("#### (50 + 25) * 3 / (50 - 50)", 0.0, False),  # division by zero
        ("#### -3 + 228", 0.0, False),  # unary minus
        ("#### import os", 0.0, False),
        ("(50 + 25) * 3", 0.0, False),  # unmarked
        ("", 0.0, False),
    ],
)
def test_countdown_grading(completion, reward, format_ok):
    g = get_task("countdown").grade(completion, COUNTDOWN_REF)
    assert (g.reward, g.format_ok) == (reward, format_ok)


def test_countdown_use_all():
    task = get_task("countdown", use_all=True)
    ref = {"numbers": [1, 3, 25, 50], "target": 225}
    assert task.grade("#### (50 + 25) * 3", ref).reward == 0.0
    assert task.grade("#### (50 + 25) * 3 * 1", ref).reward == 1.0


# -- gsm_symbolic --------------------------------------------------------------------------


@needs_rg
def test_gsm_symbolic_loads_without_the_heavy_package():
    from tidal.rl.tasks.gsm_symbolic import TEMPLATES, load_generators

    before = set(sys.modules)
    gens = load_generators()
    new = set(sys.modules) - before
    assert not [m for m in new if m.startswith("reasoning_gym") or m.startswith("sympy")], new
    assert set(TEMPLATES) <= set(gens) and len(TEMPLATES) == 85
    # Every template's worked solution ends in "#### N" and grades as correct.
    for t in TEMPLATES:
        for seed in range(3):
            ex = gens[t](random.Random(seed), 1.0)
            assert grade_number(ex["metadata"]["answer_cot"], ex["answer"], strict=True).reward == 1


@needs_rg
def test_gsm_symbolic_problems_and_grades():
    task = get_task("gsm_symbolic")
    prompt, ref = next(task.problems("train", seed=0))
    assert prompt.endswith(task.prompt_suffix) and "####" in prompt
    assert task.grade(f"Working...\n#### {ref['answer']}", ref).reward == 1.0
    assert task.grade("#### 0.123456", ref).reward == 0.0
    held = get_task("gsm_symbolic", holdout="template")
    train_t = {p.reference["template"] for p in itertools.islice(held.problems("train"), 600)}
    eval_t = {p.reference["template"] for p in itertools.islice(held.problems("eval"), 100)}
    assert eval_t and not train_t & eval_t


def test_gsm_symbolic_missing_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "reasoning_gym" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps reasoning-gym==0\.1\.25"):
        get_task("gsm_symbolic")
