"""best-fit in Python: the node left with the least free CPU and GPU after
placing the task, both normalised by the largest node spec. The same float
operations in the same order as policies/best-fit (Rust), so every score is
bit-identical and replays agree placement for placement."""

import json
import math

from wit_world import exports
from wit_world.imports import types
from componentize_py_types import Err

DEFAULTS = {"max_cpu_milli": 128_000.0, "max_gpu_milli": 8_000.0}


class Policy(exports.Policy):
    def __init__(self):
        self.max_cpu = DEFAULTS["max_cpu_milli"]
        self.max_gpu = DEFAULTS["max_gpu_milli"]

    def info(self) -> types.PolicyInfo:
        return types.PolicyInfo(name="best-fit-py", version="1.0.0", hooks=types.Hooks.SCORE)

    def configure(self, config: str) -> None:
        if not config.strip():
            return
        try:
            doc = json.loads(config)
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object")
            # Like the Rust policy, a configuration replaces the previous one:
            # absent keys fall back to the defaults, unknown keys are ignored.
            max_cpu = float(_number(doc.get("max_cpu_milli", DEFAULTS["max_cpu_milli"])))
            max_gpu = float(_number(doc.get("max_gpu_milli", DEFAULTS["max_gpu_milli"])))
        except (ValueError, TypeError) as e:
            raise Err(f"best-fit-py: bad configuration: {e}")
        self.max_cpu, self.max_gpu = max_cpu, max_gpu

    def score(self, task: types.Task, nodes: types.Nodes) -> types.Scores:
        req_cpu = float(task.cpu_milli)
        req_gpu = float(task.gpu_count * task.gpu_milli)
        max_cpu, max_gpu = self.max_cpu, self.max_gpu
        free = nodes.gpu_free_milli
        scores = []
        for cpu, start, count in zip(nodes.cpu_free_milli, nodes.gpu_start, nodes.gpu_count):
            left = (float(cpu) - req_cpu) / max_cpu * 0.5 + (float(sum(free[start:start + count])) - req_gpu) / max_gpu * 0.5
            x = (1.0 - left) * 100.0
            # math.trunc drops the sign of -0.x; Rust's f64::trunc keeps it.
            scores.append(math.copysign(float(math.trunc(x)), x))
        return types.Scores(scores=scores, gpus=[])

    def score_domains(self, task, domains):
        raise Err("best-fit-py does not score domains")

    def compact(self, snapshot):
        raise Err("best-fit-py does not compact")

    def rank(self, demand, victims):
        raise Err("best-fit-py does not rank")


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{v!r} is not a number")
    return v
