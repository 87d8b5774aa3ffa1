"""Tasks for RL: seeded prompts with held-out eval splits, and graders.

    from tidal.rl.tasks import get_task

    task = get_task("addition", digits=3)
    for prompt, reference in itertools.islice(task.problems("train", seed=0), 8):
        ...
    grade = task.grade(completion_text, reference)    # Grade(reward, answer, format_ok)

Built in: `addition` (tidal/rl/tasks/addition.py), `countdown` (countdown.py) and
`gsm_symbolic` (gsm_symbolic.py; needs `pip install --no-deps reasoning-gym==0.1.25`).
A new task is a `Task` subclass decorated with `@register("name")` (see base.py and
docs/rl.md). Answer extraction and numeric grading live in answers.py, the arithmetic
parser graders use in expr.py.
"""

from tidal.rl.tasks import addition, countdown, gsm_symbolic  # noqa: F401  (registers them)
from tidal.rl.tasks.answers import Answer, extract_answer, grade_number, parse_number
from tidal.rl.tasks.base import TASKS, Grade, Problem, Split, Task, get_task, register
from tidal.rl.tasks.expr import ExpressionError, evaluate

__all__ = [
    "TASKS",
    "Answer",
    "ExpressionError",
    "Grade",
    "Problem",
    "Split",
    "Task",
    "evaluate",
    "extract_answer",
    "get_task",
    "grade_number",
    "parse_number",
    "register",
]
