"""{{name}}: a Berth placement policy. Scores each candidate node for one
task; the host places on the highest score. This one packs: the node left
with the least free GPU after placing the task wins."""

from wit_world import exports
from wit_world.imports import types
from componentize_py_types import Err


class Policy(exports.Policy):
    def info(self) -> types.PolicyInfo:
        # The host calls only the hooks claimed here.
        return types.PolicyInfo(name="{{name}}", version="0.1.0", hooks=types.Hooks.SCORE)

    def configure(self, config: str) -> None:
        # TOML or JSON text from the operator; empty for defaults. Raise
        # Err("why") to reject it (the previous configuration stays).
        pass

    def score(self, task: types.Task, nodes: types.Nodes) -> types.Scores:
        wanted = float(task.gpu_count * task.gpu_milli)
        free = nodes.gpu_free_milli
        scores = [
            -(float(sum(free[start:start + count])) - wanted)
            for start, count in zip(nodes.gpu_start, nodes.gpu_count)
        ]
        # One finite score per node, in batch order; no GPU masks: the host
        # chooses the GPUs on the winning node.
        return types.Scores(scores=scores, gpus=[])

    # Optional hooks. The host calls only those claimed in info(), e.g.
    # hooks=types.Hooks.SCORE | types.Hooks.POOL_PLACE; `berth policy test`
    # then checks the claimed ones too. Unclaimed, they are never called.

    def score_domains(self, task, domains):
        raise Err("not implemented")

    def compact(self, snapshot):
        raise Err("not implemented")

    def rank(self, demand, victims):
        raise Err("not implemented")

    # Contract 0.3.0, model pools (`berth replay --pool`). Unclaimed, the
    # host's defaults apply: every model on every executor of its
    # tensor-parallel degree, unpinned; each step prefills the row whose
    # oldest request waited longest, else decodes the row with least slack.
    def pool_place(self, state: types.PoolState) -> types.PoolPlacement:
        # Return the complete assignment, as pairs (executor, model,
        # weight >= 1, pinned 0/1).
        raise Err("not implemented")

    def pool_step(self, executor: types.PoolExecutor) -> types.PoolChoice:
        # Return types.PoolChoice(phase=types.PoolPhase.PREFILL, row=r,
        # iterations=1, evict=[]) to prefill row r of `executor`.
        raise Err("not implemented")
