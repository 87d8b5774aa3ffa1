"""A verifiers taskset, written as verifiers' users write one (`vf-init` scaffolds this shape):
two-number additions, rewarded 1 for the sum at the end of the reply plus half the share of
digits in it (a signal a seed-initialized model moves). The taskset id is the package name,
`vf_addition`, importable with this folder on PYTHONPATH."""

import random

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: str


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.endswith(self.data.answer))

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return sum(c.isdigit() for c in reply) / max(len(reply), 1)


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """How many problems."""


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        rng = random.Random(0)
        tasks = []
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            data = AdditionData(prompt=f"What is {a} + {b}?", answer=str(a + b))
            tasks.append(AdditionTask(data, self.config.task))
        return tasks


__all__ = ["AdditionTaskset"]
