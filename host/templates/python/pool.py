"""{{name}}: a Berth model-pool policy (contract 0.3.0). pool-place
balances demand: models in order of demand (arrival rate x executor-seconds
per request, highest first), each on the executor of its tensor-parallel
degree with the least demand so far, unpinned (loaded when a step runs
it). pool-step keeps tokens on time: a decoding batch about to be late
decodes first, else the oldest waiting request's model is prefilled, else
the batch with the least slack decodes."""

from wit_world import exports
from wit_world.imports import types
from componentize_py_types import Err

# Decode iterations per step (the host caps it; the default market at 64).
ITERATIONS = 4


class Policy(exports.Policy):
    def info(self) -> types.PolicyInfo:
        # The host calls only the hooks claimed here.
        return types.PolicyInfo(name="{{name}}", version="0.1.0", hooks=types.Hooks.POOL_PLACE | types.Hooks.POOL_STEP)

    def configure(self, config: str) -> None:
        # TOML or JSON text from the operator; empty for defaults.
        pass

    def pool_place(self, s: types.PoolState) -> types.PoolPlacement:
        demand = [rate * service for rate, service in zip(s.model_rate, s.model_service_s)]
        load = [0.0] * len(s.executor_tp)
        executor, model = [], []
        for m in sorted(range(len(demand)), key=lambda m: (-demand[m], m)):
            mine = [e for e, tp in enumerate(s.executor_tp) if tp == s.model_tp[m]]
            if not mine:
                continue  # no executor of its degree in this pool
            e = min(mine, key=lambda e: (load[e], e))
            load[e] += demand[m]
            executor.append(e)
            model.append(m)
        # The complete assignment, as pairs: executor, model, routing
        # weight >= 1, pinned 0/1 (a list<u8> is bytes in Python).
        return types.PoolPlacement(executor=executor, model=model, weight=[1] * len(model), pinned=bytes(len(model)))

    def pool_step(self, x: types.PoolExecutor) -> types.PoolChoice:
        rows = range(len(x.model))
        decoding = [r for r in rows if x.decoding[r] > 0]
        waiting = [r for r in rows if x.waiting[r] > 0]
        urgent = min(decoding, key=lambda r: (x.decode_slack_ms[r], r), default=None)
        if urgent is not None and x.decode_slack_ms[urgent] < 2 * x.tbt_target_ms:
            return types.PoolChoice(phase=types.PoolPhase.DECODE, row=urgent, iterations=ITERATIONS, evict=[])
        if waiting:
            oldest = min(waiting, key=lambda r: (-x.oldest_wait_ms[r], r))
            return types.PoolChoice(phase=types.PoolPhase.PREFILL, row=oldest, iterations=1, evict=[])
        if urgent is not None:
            return types.PoolChoice(phase=types.PoolPhase.DECODE, row=urgent, iterations=ITERATIONS, evict=[])
        return types.PoolChoice(phase=types.PoolPhase.IDLE, row=0, iterations=1, evict=[])

    # Hooks not claimed in info(): never called.
    def score(self, task, nodes):
        raise Err("not implemented")

    def score_domains(self, task, domains):
        raise Err("not implemented")

    def compact(self, snapshot):
        raise Err("not implemented")

    def rank(self, demand, victims):
        raise Err("not implemented")
