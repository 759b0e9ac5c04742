"""{{name}}: a Berth compaction policy. Plans moves that free whole nodes,
one move per allocation: the emptiest nodes whose allocations may all move
(movable, not in a gang) go first, and each allocation goes to the busy
node of the same GPU model left with the least free GPU that has room. A
node whose allocations cannot all move is left alone. The host checks the
plan and runs each chain make-before-break."""

from wit_world import exports
from wit_world.imports import types
from componentize_py_types import Err


def fit_gpus(free: list[int], count: int, milli: int):
    """The GPU mask an allocation of `count` GPUs at `milli` each takes
    among `free` (free thousandths per GPU), or None if it does not fit:
    whole GPUs lowest index first, a shared GPU the fullest that fits."""
    if count == 0:
        return 0
    if milli < 1000:
        fits = [g for g in range(len(free)) if free[g] >= milli]
        return 1 << min(fits, key=lambda g: (free[g], g)) if fits else None
    chosen = [g for g in range(len(free)) if free[g] >= milli][:count]
    return sum(1 << g for g in chosen) if len(chosen) == count else None


class Policy(exports.Policy):
    def info(self) -> types.PolicyInfo:
        # The host calls only the hooks claimed here.
        return types.PolicyInfo(name="{{name}}", version="0.1.0", hooks=types.Hooks.COMPACT)

    def configure(self, config: str) -> None:
        # TOML or JSON text from the operator; empty for defaults. Raise
        # Err("why") to reject it (the previous configuration stays).
        pass

    def compact(self, snapshot: types.Snapshot) -> types.Plan:
        n, a = snapshot.nodes, snapshot.allocations
        free = [list(n.gpu_free_milli[s:s + c]) for s, c in zip(n.gpu_start, n.gpu_count)]
        cpu, mem = list(n.cpu_free_milli), list(n.memory_free_mib)
        position = {}
        for k, node_id in enumerate(n.ids):
            position.setdefault(node_id, k)
        on = [[] for _ in n.ids]
        for i, node_id in enumerate(a.node):
            if node_id in position:
                on[position[node_id]].append(i)
        count = [bin(mask).count("1") for mask in a.gpus]
        candidates = [k for k in range(len(n.ids)) if on[k] and all(a.movable[i] == 1 and a.gang_id[i] == 0 for i in on[k])]
        candidates.sort(key=lambda k: (sum(1000 - min(f, 1000) for f in free[k]), len(on[k]), k))
        emptied, received = set(), set()
        plan = types.Plan(chain=[], allocation=[], dest_node=[], dest_gpus=[])
        for t in candidates:
            if t in received:
                continue
            residents = sorted(on[t], key=lambda i: (-count[i] * a.gpu_milli[i], -a.cpu_milli[i], i))
            moves = []
            for i in residents:
                best = None
                for k in range(len(n.ids)):
                    if k == t or k in emptied or not on[k] or (count[i] and n.model[k] != n.model[t]):
                        continue
                    if cpu[k] < a.cpu_milli[i] or mem[k] < a.memory_mib[i]:
                        continue
                    mask = fit_gpus(free[k], count[i], a.gpu_milli[i])
                    if mask is not None and (best is None or sum(free[k]) < best[0]):
                        best = (sum(free[k]), k, mask)
                if best is None:
                    break
                _, k, mask = best
                self._take(free, cpu, mem, k, mask, a, i, -1)
                on[k].append(i)
                moves.append((i, k, mask))
            if len(moves) < len(residents):
                for i, k, mask in reversed(moves):
                    self._take(free, cpu, mem, k, mask, a, i, +1)
                    on[k].pop()
                continue
            chain = len(emptied)
            for i, k, mask in moves:
                received.add(k)
                plan.chain.append(chain)
                plan.allocation.append(a.ids[i])
                plan.dest_node.append(n.ids[k])
                plan.dest_gpus.append(mask)
            on[t] = []
            emptied.add(t)
        return plan

    @staticmethod
    def _take(free, cpu, mem, k, mask, a, i, sign):
        """Takes (sign -1) or gives back (+1) allocation i's room on node k."""
        cpu[k] += sign * a.cpu_milli[i]
        mem[k] += sign * a.memory_mib[i]
        for g in range(len(free[k])):
            if mask >> g & 1:
                free[k][g] += sign * a.gpu_milli[i]

    # Hooks not claimed in info(): never called.
    def score(self, task, nodes):
        raise Err("not implemented")

    def score_domains(self, task, domains):
        raise Err("not implemented")

    def rank(self, demand, victims):
        raise Err("not implemented")

    def pool_place(self, state):
        raise Err("not implemented")

    def pool_step(self, executor):
        raise Err("not implemented")
